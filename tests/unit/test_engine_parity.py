"""Greedy tokens equal Hugging Face transformers' generate on the same weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    greedy_params,
    hf_greedy,
    make_prompts,
)

MAX_NEW = 32


def _check(model_dir: Path, lengths: list[int], **engine_kwargs: object) -> None:
    engine = Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **engine_kwargs,
    )
    prompts = make_prompts(engine.runner.vocab_size, lengths)
    # All prompts go in one call: they share continuous batches of mixed lengths.
    ours = engine_outputs(engine, prompts, MAX_NEW)
    refs = hf_greedy(model_dir, prompts, MAX_NEW)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref)
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0


@pytest.mark.slow
def test_tiny_llama_matches_hf(tiny_llama_dir: Path) -> None:
    _check(tiny_llama_dir, [5, 17, 40, 3, 64])


@pytest.mark.slow
def test_tiny_qwen3_matches_hf(tiny_qwen3_dir: Path) -> None:
    _check(tiny_qwen3_dir, [7, 30, 2, 51])


@pytest.mark.slow
def test_repetition_penalty_matches_hf(tiny_llama_dir: Path) -> None:
    """HF's RepetitionPenaltyLogitsProcessor over prompt + output, with the penalty state
    kept on the device across steps, with and without overlap scheduling."""
    engine = Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", debug_check_invariants=True
    )
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40, 3])
    refs = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, repetition_penalty=0.7)
    free = engine_outputs(engine, prompts, MAX_NEW)
    for overlap in (False, True):
        engine.scheduler.overlap = overlap
        outs = engine.generate(
            input_ids=prompts, sampling_params={**greedy_params(MAX_NEW), "repetition_penalty": 0.7}
        )
        assert isinstance(outs, list)
        for out, ref, unpenalized in zip(outs, refs, free, strict=True):
            assert out["output_ids"] != unpenalized  # the penalty changes every output
            assert_matches_reference(out["output_ids"], ref)
    assert engine.scheduler.total_exact_state_waits == 0


@pytest.mark.slow
def test_smollm2_gguf_matches_hf(smollm2_dir: Path) -> None:
    _check(smollm2_dir, [9, 33, 80])
