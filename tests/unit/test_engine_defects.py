"""Regression tests for the engine defects of the review (one per item)."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.config import EngineConfig
from radixserve.engine.kvcache.pool import KVPool
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    greedy_params,
    hf_greedy,
    make_prompts,
)


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )


# -- 1. context_length above the model's max_position_embeddings ---------------------------
def test_context_longer_than_trained_positions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = make_tiny_llama(tmp_path / "short", seed=4, max_position_embeddings=64)
    with caplog.at_level(logging.WARNING):
        engine = _engine(model_dir, context_length=160)
    assert engine.context_len == 160
    assert any("max_position_embeddings" in r.getMessage() for r in caplog.records)
    (ids,) = make_prompts(engine.runner.vocab_size, [90], seed=5)
    out = engine.generate(input_ids=ids, sampling_params=greedy_params(12))
    assert isinstance(out, dict)
    # Hugging Face computes the rotation for any position: the reference past 64.
    (ref,) = hf_greedy(model_dir, [ids], 12)
    assert_matches_reference(out["output_ids"], ref)


# -- 2. a request mid-chunk must not get a lone decoder aborted ------------------------------
@pytest.mark.slow
def test_chunked_request_cannot_starve_a_lone_decoder(tiny_llama_dir: Path) -> None:
    options = {
        "max_total_tokens": 200,
        "chunked_prefill_size": 32,
        "init_new_token_ratio": 0.0,  # the decayed ratio: no future tokens reserved
        "min_new_token_ratio": 0.0,
    }
    engine = _engine(tiny_llama_dir, **options)
    a_ids, b_ids = make_prompts(engine.runner.vocab_size, [10, 185], seed=6)
    a_params = {**greedy_params(100), "ignore_eos": True}
    b_params = {**greedy_params(8), "ignore_eos": True}
    a = engine.submit(a_ids, a_params)
    finished: dict[str, dict[str, object]] = {}
    for _ in range(3):  # A is decoding alone
        engine.step()
    b = engine.submit(b_ids, b_params)
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                finished[out.rid] = out.req.finish_reason.to_dict()  # type: ignore[union-attr]
        if not engine.has_work():
            break
    assert finished == {a: {"type": "length"}, b: {"type": "length"}}
    # Same tokens as with room to spare.
    roomy = _engine(tiny_llama_dir)
    ref = roomy.generate(input_ids=[a_ids, b_ids], sampling_params=[a_params, b_params])
    assert isinstance(ref, list)
    assert [len(r["output_ids"]) for r in ref] == [100, 8]


# -- 3. n > 1: aborting every child aborts the shared prefill; nothing stays tracked ---------
def test_aborting_every_choice_aborts_the_shared_prefill(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, chunked_prefill_size=16)
    (ids,) = make_prompts(engine.runner.vocab_size, [120], seed=7)
    rid = engine.submit(ids, {"n": 3, "max_new_tokens": 8, "temperature": 1.0})
    engine.step()  # the shared prefill is mid-chunk
    engine.abort(rid)
    for _ in range(5):
        engine.step()
    assert not engine.has_work(), "the hidden prefill kept running after its choices were aborted"
    assert engine.num_tracked() == 0
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0


def test_generate_that_raises_leaves_nothing_tracked(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    (ids,) = make_prompts(engine.runner.vocab_size, [30], seed=8)
    good = {"n": 2, "max_new_tokens": 4}
    with pytest.raises(ValueError):
        # The second prompt is rejected after the first was submitted.
        engine.generate(input_ids=[ids, [engine.runner.vocab_size + 5]], sampling_params=good)
    assert engine.num_tracked() == 0
    for _ in range(10):
        engine.step()
    assert not engine.has_work()


# -- 4. spaces_between_special_tokens is honoured; wire and engine params match -------------
def test_spaces_between_special_tokens_is_honoured(tiny_llama_dir: Path) -> None:
    from radixserve.engine.outputs import full_text
    from radixserve.engine.request import FinishReason, Req
    from radixserve.engine.sampling.params import SamplingParams

    engine = _engine(tiny_llama_dir)
    tok = engine.tokenizer
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    output = [start, *tok.encode("assistant"), end]
    texts = {}
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        req = Req("r", [1], params, seed=0, stop_token_ids=frozenset(), output_ids=output)
        req.finish_reason = FinishReason("length")
        texts[spaces] = full_text(req, tok)
    assert texts[False] == tok.decode(output, skip_special_tokens=False)
    assert texts[True] == "<|im_start|> assistant <|im_end|>"


def test_wire_and_engine_sampling_params_have_the_same_fields() -> None:
    import dataclasses

    import msgspec

    from radixserve.engine.sampling.params import SamplingParams as EngineParams
    from radixserve.protocol import SamplingParams as WireParams

    engine_fields = {f.name: f.default for f in dataclasses.fields(EngineParams)}
    wire_fields = {f.name: f.default for f in msgspec.structs.fields(WireParams)}
    assert set(engine_fields) == set(wire_fields)
    for name, default in engine_fields.items():
        if default is not dataclasses.MISSING:
            assert wire_fields[name] == default, name


# -- 5. smaller ----------------------------------------------------------------------------
def test_double_free_raises_in_debug_mode_with_page_size_one() -> None:
    pool = KVPool(16, 1, 1, 1, torch.float32, "cpu", page_size=1, debug=True)
    slots = pool.alloc(4)
    assert slots is not None
    pool.free(slots)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(slots[:1])


@pytest.mark.parametrize("backend", ["xformers"])
def test_unknown_attention_backend_is_rejected_by_the_config(backend: str) -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend=backend)


def test_shutdown_releases_the_model_and_the_kv_pool(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    model_ref = weakref.ref(engine.runner.model)
    kv_ref = weakref.ref(engine.runner.kv_pool.k_buffers[0])
    (ids,) = make_prompts(engine.runner.vocab_size, [12], seed=10)
    engine.generate(input_ids=ids, sampling_params=greedy_params(3))
    engine.shutdown()
    gc.collect()
    assert model_ref() is None and kv_ref() is None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=ids, sampling_params=greedy_params(3))
    with _engine(tiny_llama_dir) as second:
        out = second.generate(input_ids=ids, sampling_params=greedy_params(3))
        assert isinstance(out, dict) and len(out["output_ids"]) == 3
