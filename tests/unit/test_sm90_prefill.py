"""When a prefill pass runs FlashInfer's SM90 kernels (attention/sm90_prefill.py): the
choice is host arithmetic over the pass's lengths, checked here against the step
shapes its constants were measured on (lab/probes/prefill_kernels.py, lab/notebook/2026-11-26-long-prompts-flashinfer-sm90-prefill-shared.md)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.attention.sm90_prefill import (
    LONG_QUERY,
    MIN_PAIRS_BESIDE_CASCADE,
    SHORT_KEY_WEIGHT,
    Sm90Build,
    causal_pairs,
    is_sm90,
    use_sm90,
)
from radixserve.engine.config import EngineConfig
from radixserve.engine.flags import add_engine_arguments, engine_kwargs


def brute_pairs(new: int, kv: int) -> int:
    cached = kv - new
    return sum(cached + i + 1 for i in range(new))


@pytest.mark.parametrize(("new", "kv"), [(1, 1), (1, 2300), (128, 2176), (2048, 2048), (7, 9)])
def test_causal_pairs_counts_each_query_over_the_keys_it_sees(new: int, kv: int) -> None:
    assert causal_pairs(new, kv) == brute_pairs(new, kv)


def test_long_prompts_alone_run_sm90() -> None:
    assert use_sm90([2048], [32768], beside_cascade=False)  # a long prompt's last chunk
    assert use_sm90([2048], [2048], beside_cascade=False)  # a first chunk
    assert use_sm90([LONG_QUERY], [LONG_QUERY], beside_cascade=False)


def test_few_token_requests_alone_stay_on_fa2() -> None:
    assert not use_sm90([1] * 480, [2300] * 480, beside_cascade=False)  # decoders
    assert not use_sm90([16] * 64, [2064] * 64, beside_cascade=False)  # short prompts
    assert not use_sm90([LONG_QUERY - 1], [4096], beside_cascade=False)


def test_decoders_beside_a_chunk_weigh_against_its_pairs() -> None:
    # The uncached shared-prefix run's mixed step: a chunk over two prompts beside ~145
    # decoders over ~2300 keys: FA2 (its decoders cost the SM90 kernel more).
    new, kv = [128, 1920] + [1] * 145, [2176, 1920] + [2300] * 145
    assert not use_sm90(new, kv, beside_cascade=False)
    # A 32k prompt's last chunk beside 64 decoders: measured faster on SM90 (2.87 ms
    # against 3.45 a layer on an H100).
    assert use_sm90([2048] + [1] * 64, [32768] + [2300] * 64, beside_cascade=False)
    # At the weight: just enough long pairs for the short keys.
    pairs = causal_pairs(2048, 8192)
    short = pairs // SHORT_KEY_WEIGHT
    assert use_sm90([2048, 1], [8192, short], beside_cascade=False)
    assert not use_sm90([2048, 1], [8192, short + 1], beside_cascade=False)


def test_beside_cascade_only_large_prefills_run_sm90() -> None:
    # The cached shared-prefix run's question and prefix steps keep the side stream's
    # overlap (FA2); a long prompt's chunk beside cascade decoders does not need it.
    assert not use_sm90([128] * 16, [2176] * 16, beside_cascade=True)
    assert not use_sm90([2048], [2048], beside_cascade=True)
    assert use_sm90([2048], [8192], beside_cascade=True)
    assert causal_pairs(2048, 8192) >= MIN_PAIRS_BESIDE_CASCADE > causal_pairs(2048, 4096)


def test_the_cpu_is_not_sm90() -> None:
    assert not is_sm90(torch.device("cpu"))


def test_asking_for_it_where_it_cannot_act_says_so(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="radixserve.engine.runner"):
        engine = Engine(model_path=str(tiny_llama_dir), device="cpu", enable_sm90_prefill=True)
    try:
        assert "enable_sm90_prefill has no effect here" in caplog.text
        assert "torch" in caplog.text  # the backend the prefills run on
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert isinstance(out, dict) and len(out["output_ids"]) == 2
    finally:
        engine.shutdown()


def test_it_is_opt_in_by_the_flag_or_the_variable() -> None:
    assert EngineConfig().enable_sm90_prefill is False
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flagged = engine_kwargs(parser.parse_args(["--enable-sm90-prefill"]), environ={})
    assert EngineConfig(**flagged).enable_sm90_prefill is True
    env = {"RADIXSERVE_ENABLE_SM90_PREFILL": "true"}
    assert engine_kwargs(parser.parse_args([]), environ=env) == {"enable_sm90_prefill": True}


def test_a_build_is_ready_once_its_compile_ran_and_never_if_it_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[bool] = []
    built = Sm90Build(lambda: ran.append(True))
    assert built.wait(10) and built.ready and ran == [True]

    def no_compiler() -> None:
        raise RuntimeError("nvcc not found")

    with caplog.at_level(logging.WARNING, logger="radixserve.engine.attention.sm90_prefill"):
        failed = Sm90Build(no_compiler)
        assert not failed.wait(10) and not failed.ready
    assert "stay on FA2" in caplog.text and "nvcc not found" in caplog.text
