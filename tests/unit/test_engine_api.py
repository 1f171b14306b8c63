"""Engine API behaviour: n > 1, stop conditions, logprobs, streaming, bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import Engine
from tests.unit.engine_helpers import greedy_params, make_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", debug_check_invariants=True
    )


def test_n_samples_share_the_prompt(engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [60], seed=21)
    outs = engine.generate(
        input_ids=ids, sampling_params={"n": 4, "max_new_tokens": 8, "temperature": 1.0, "seed": 5}
    )
    assert isinstance(outs, list) and len(outs) == 4
    for out in outs:
        assert out["meta_info"]["cached_tokens"] == len(ids) - 1
        assert len(out["output_ids"]) == 8
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, (
        "different seeds should give different samples"
    )
    again = engine.generate(
        input_ids=ids, sampling_params={"n": 4, "max_new_tokens": 8, "temperature": 1.0, "seed": 5}
    )
    assert isinstance(again, list)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_stop_token_and_length(engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [20], seed=22)
    free = engine.generate(input_ids=ids, sampling_params=greedy_params(10))
    assert isinstance(free, dict) and free["meta_info"]["finish_reason"] == {"type": "length"}
    stop_at = free["output_ids"][3]
    first = free["output_ids"].index(stop_at)
    out = engine.generate(
        input_ids=ids,
        sampling_params={
            "max_new_tokens": 10,
            "temperature": 0,
            "stop_token_ids": [stop_at],
            "min_new_tokens": 0,
        },
    )
    assert isinstance(out, dict)
    assert out["output_ids"] == free["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_trims_text(engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [20], seed=23)
    free = engine.generate(input_ids=ids, sampling_params=greedy_params(12))
    assert isinstance(free, dict)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop, "the reference text is too short"
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": [stop]}
    )
    assert isinstance(out, dict)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]


def test_logprobs_match_log_softmax(engine: Engine, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    (ids,) = make_prompts(engine.runner.vocab_size, [15], seed=24)
    out = engine.generate(
        input_ids=ids,
        sampling_params={**greedy_params(3), "return_logprob": True, "top_logprobs_num": 3},
    )
    assert isinstance(out, dict)
    logprobs = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    seq = torch.tensor([ids + out["output_ids"]])
    with torch.inference_mode():
        ref = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    for i, ((lp, tok), top) in enumerate(zip(logprobs, tops, strict=True)):
        row = ref[len(ids) - 1 + i]
        assert tok == out["output_ids"][i]
        assert abs(lp - float(row[tok])) < 1e-3
        ref_top = torch.topk(row, 3)
        assert [t for t, _ in top] == ref_top.indices.tolist()


def test_stream_deltas_add_up(engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [25], seed=25)
    whole = engine.generate(input_ids=ids, sampling_params=greedy_params(10))
    assert isinstance(whole, dict)

    async def collect() -> list[dict[str, object]]:
        return [
            d
            async for d in engine.generate_stream(input_ids=ids, sampling_params=greedy_params(10))
        ]

    deltas = asyncio.run(collect())
    assert deltas[-1]["finished"] is True
    assert "".join(str(d["text"]) for d in deltas) == whole["text"]
    assert [t for d in deltas for t in d["output_ids"]] == whole["output_ids"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": []}, "empty"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"input_ids": [5, 6.5]}, "integers"),
        ({"input_ids": [[5], []]}, "empty"),
        ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [5], "sampling_params": {"regex": "[a-"}}, "'regex' is not a valid grammar"),
        ({"prompt": "x", "input_ids": [5]}, "exactly one"),
    ],
)
def test_bad_input_is_rejected(engine: Engine, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)  # type: ignore[arg-type]
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0


def test_prompt_longer_than_context_is_rejected(engine: Engine) -> None:
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * (engine.context_len + 1))


def test_submit_takes_a_numpy_array_as_the_same_prompt(engine: Engine) -> None:
    prompt = [5, 17, 99, 3, 42, 8]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    expected = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    # The worker hands the engine the wire's int32 array, not a list.
    rid = engine.submit(np.array(prompt, dtype=np.int32), params)
    with pytest.raises(ValueError, match="integers"):
        engine.submit([5.0, 17.0], params)
    got: list[int] = []
    while engine.has_work():
        for out in engine.step():
            assert out.rid == rid  # the refused prompt left nothing queued
            got += out.new_token_ids
    assert got == expected


@pytest.mark.slow
def test_generate_from_several_threads_at_once(engine: Engine) -> None:
    """Callers on their own threads share the steps: each gets what it gets alone, even
    when another thread's step finishes its request (which once read as an idle engine)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = make_prompts(engine.runner.vocab_size, [9, 30, 4, 17, 22, 6, 40, 11], seed=33)
    lengths = [3, 12, 1, 7, 5, 2, 9, 4]  # short ones finish inside longer ones' steps
    alone = [
        engine.generate(input_ids=p, sampling_params=greedy_params(n))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [
                pool.submit(engine.generate, input_ids=p, sampling_params=greedy_params(n))
                for p, n in zip(prompts, lengths, strict=True)
            ]
            together = [f.result(timeout=120) for f in futures]
        assert [t["output_ids"] for t in together] == [a["output_ids"] for a in alone]  # type: ignore[index]
    assert engine.num_tracked() == 0
