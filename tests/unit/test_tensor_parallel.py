"""Tensor parallelism on the CPU (gloo): an engine of two ranks generates what one rank
does (greedy tokens, seeded samples, n > 1, stop strings, aborts, a flush), with each
rank holding half the heads, MLP rows, embedding rows and head rows (vocabulary-parallel
embeddings and head, tied or not: each rank loads only its rows); bad sizes are refused
clearly. test_tensor_parallel_head.py checks the vocabulary-parallel logprobs."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.distributed import TPGroup
from radixserve.engine.model.llama import LlamaForCausalLM
from radixserve.engine.model.loader import load_model
from radixserve.model_files.config import ModelConfig
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(300)

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    one = Engine(str(tiny_llama_dir), **ENGINE)
    two = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    try:
        yield one, two
    finally:
        two.shutdown()
        one.shutdown()


@pytest.mark.slow
def test_two_ranks_generate_what_one_does(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    assert two.runner.kv_pool.k_buffers[0].shape[1] == 1  # 2 KV heads over 2 ranks
    assert two.runner.model.model.layers[0].mlp.intermediate_size == 64
    vocab = one.runner.vocab_size
    assert two.runner.model.lm_head.weight.shape[0] == vocab // 2  # untied: its rows only
    assert two.runner.model.model.embed_tokens.weight.shape[0] == vocab // 2
    prompts = make_prompts(one.runner.vocab_size, [5, 33, 12, 70, 8], seed=3)
    cases = [
        {"max_new_tokens": 12, "temperature": 0},
        {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7},
        {"max_new_tokens": 6, "temperature": 0.7, "n": 3, "seed": 11},
    ]
    for params in cases:
        expected = one.generate(input_ids=prompts, sampling_params=params)
        got = two.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(expected, list) and isinstance(got, list)
        for e, g in zip(expected, got, strict=True):
            if "choices" in e:  # n > 1
                assert [c["output_ids"] for c in g["choices"]] == [
                    c["output_ids"] for c in e["choices"]
                ]
            else:
                assert g["output_ids"] == e["output_ids"], params
    # The second pass over the same prompts hit both radix caches alike.
    again = two.generate(input_ids=prompts[1], sampling_params=cases[0])
    assert isinstance(again, dict) and again["meta_info"]["cached_tokens"] > 0


def test_aborts_and_a_flush_keep_the_ranks_in_step(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    prompts = make_prompts(one.runner.vocab_size, [40, 9], seed=5)
    rid = two.submit(prompts[0], {"max_new_tokens": 500, "ignore_eos": True})
    for _ in range(3):
        two.step()
    assert two.abort(rid)
    while two.has_work():
        two.step()
    two.forget(rid)
    assert two.flush_cache()
    expected = one.generate(
        input_ids=prompts[1], sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    got = two.generate(
        input_ids=prompts[1], sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert isinstance(got, dict) and isinstance(expected, dict)
    assert got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["cached_tokens"] == 0  # flushed on every rank
    assert two.num_tracked() == 0


@pytest.mark.slow
def test_priorities_and_the_starvation_bound_keep_the_ranks_in_step(
    engines: tuple[Engine, Engine],
) -> None:
    """Mixed priorities, two requests past the starvation bound: every rank admits in
    rank 0's order (its priorities, arrivals and each step's clock reading travel with
    the commands), so the batch rows line up and the tokens are one rank's."""
    prompts = make_prompts(engines[0].runner.vocab_size, [9, 14, 7, 20, 11], seed=13)
    outputs = []
    for engine in engines:
        clock = [1000.0]
        engine.scheduler.clock = lambda clock=clock: clock[0]  # type: ignore[misc]
        got: dict[str, list[int]] = {}
        for i, (ids, priority) in enumerate(zip(prompts, [0, 0, 1, 2, 0], strict=True)):
            if i == 2:
                clock[0] += 30.0  # the first two are past the bound (10 s) from here on
            engine.submit(
                ids, {"max_new_tokens": 6, "temperature": 0}, rid=f"p-{i}", priority=priority
            )
        order = sorted(engine.scheduler.waiting, key=lambda r: r.arrival_order)
        assert [r.priority for r in order] == [0, 0, 1, 2, 0]
        while engine.has_work():
            for out in engine.step():
                got.setdefault(out.rid, []).extend(out.new_token_ids)
        engine.scheduler.clock = time.monotonic
        outputs.append(got)
    assert outputs[1] == outputs[0] and len(outputs[0]) == 5


def test_shard_sizes_must_divide(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama_dir)  # 4 heads, 2 KV heads
    with torch.device("meta"), pytest.raises(ValueError, match="tp_size 3 does not divide"):
        LlamaForCausalLM(config, TPGroup(rank=0, size=3))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TPGroup(rank=2, size=2)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        Engine(str(tiny_llama_dir), tp_size=0, **ENGINE)
    # A rank's rows of a checkpoint's embeddings would not show they are too many.
    short = dataclasses.replace(config, vocab_size=config.vocab_size - 2)
    with pytest.raises(ValueError, match="expected the vocabulary's"):
        load_model(tiny_llama_dir, "float32", config=short, tp=TPGroup(rank=1, size=2))


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_each_rank_loads_its_rows_of_the_vocabulary(
    model_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Rank r of 2 holds rows [r V/2, (r+1) V/2) of the embeddings and of an untied head,
    and a tied head is those rows themselves (loading needs no process group)."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    whole, config = load_model(model_dir, dtype="float32")
    half = config.vocab_size // 2
    for rank in range(2):
        part, _ = load_model(model_dir, dtype="float32", tp=TPGroup(rank=rank, size=2))
        rows = slice(rank * half, (rank + 1) * half)
        embeddings, head = part.model.embed_tokens.weight, part.lm_head.weight
        assert torch.equal(embeddings, whole.model.embed_tokens.weight[rows])
        assert torch.equal(head, whole.lm_head.weight[rows])
        assert (head.data_ptr() == embeddings.data_ptr()) == config.tie_word_embeddings


@pytest.mark.slow
def test_constrained_requests_compile_their_grammar_on_every_rank(
    engines: tuple[Engine, Engine],
) -> None:
    one, two = engines
    params = {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)[0-9]{1,4}"}
    expected = one.generate("Answer:", params)
    got = two.generate("Answer:", params)
    assert isinstance(got, dict) and isinstance(expected, dict)
    assert got["output_ids"] == expected["output_ids"] and got["text"] == expected["text"]
    assert re.fullmatch("(yes|no)[0-9]{1,4}", got["text"]), got["text"]
