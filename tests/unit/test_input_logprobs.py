"""Prompt logprobs (`return_logprob` with `logprob_start_len`): every prompt token's
logprob from the start position on equals Hugging Face's log-softmax of the same
weights' logits at the position before it, also when the prompt is in the radix cache
(its tokens are computed again), split over prefill chunks, with top logprobs, for each
of n choices; the prompt's first token has none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from tests.unit.engine_helpers import hf_log_softmax, make_prompts

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Any:
    return hf_log_softmax(tiny_llama_dir)


def _engine(model_dir: Path, **options: Any) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **options,
    )


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return _engine(tiny_llama_dir)


def _params(start: int, **extra: Any) -> dict[str, Any]:
    return {
        "max_new_tokens": 2,
        "temperature": 0,
        "return_logprob": True,
        "logprob_start_len": start,
        **extra,
    }


def _check(meta: dict[str, Any], ids: list[int], start: int, ref: torch.Tensor) -> None:
    entries = meta["input_token_logprobs"]
    assert [tok for _, tok in entries] == ids[start:]
    for j, (lp, tok) in zip(range(start, len(ids)), entries, strict=True):
        if j == 0:
            assert lp is None
        else:
            assert lp == pytest.approx(float(ref[j - 1, tok]), abs=1e-4)


@pytest.mark.parametrize("start", [0, 1, 17, 39])
def test_prompt_logprobs_match_hugging_face(engine: Engine, reference: Any, start: int) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [40], seed=start + 3)
    out = engine.generate(input_ids=ids, sampling_params=_params(start))
    assert isinstance(out, dict)
    _check(out["meta_info"], ids, start, reference(ids))
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


def test_a_cached_prompt_is_computed_again_from_the_start(engine: Engine, reference: Any) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [48], seed=91)
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert isinstance(plain, dict)
    out = engine.generate(input_ids=ids, sampling_params=_params(20))
    assert isinstance(out, dict)
    assert out["meta_info"]["cached_tokens"] <= 19  # the prefix before the first query only
    _check(out["meta_info"], ids, 20, reference(ids))
    again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert isinstance(again, dict)
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1  # the cache still serves it


def test_chunked_prefill_top_logprobs_and_n_choices(tiny_llama_dir: Path, reference: Any) -> None:
    engine = _engine(tiny_llama_dir, chunked_prefill_size=16)
    try:
        (ids,) = make_prompts(engine.runner.vocab_size, [70], seed=5)
        ref = reference(ids)
        outs = engine.generate(input_ids=ids, sampling_params=_params(3, top_logprobs_num=4, n=2))
        assert isinstance(outs, list) and len(outs) == 2
        for out in outs:
            meta = out["meta_info"]
            _check(meta, ids, 3, ref)
            tops = meta["input_top_logprobs"]
            assert len(tops) == len(ids) - 3
            for j, top in zip(range(3, len(ids)), tops, strict=True):
                expected = torch.topk(ref[j - 1], 4)
                assert [t for t, _ in top] == expected.indices.tolist()
                assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
    finally:
        engine.shutdown()


def test_edges_and_bad_values(engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [6], seed=8)
    out = engine.generate(input_ids=ids, sampling_params=_params(6))
    assert isinstance(out, dict)
    assert out["meta_info"]["input_token_logprobs"] == []  # starts past the prompt
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1, "logprob_start_len": 0}
    )
    assert isinstance(out, dict)
    assert "input_token_logprobs" not in out["meta_info"]  # only with return_logprob
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, sampling_params=_params(-2))
    assert engine.num_tracked() == 0
