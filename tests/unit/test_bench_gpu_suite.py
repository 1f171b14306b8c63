"""bench/gpu_suite.py's report on the CPU: targets picked and judged from stage results
as the suite's children write them (the stages themselves need a GPU)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def suite(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # the scripts import each other as siblings
    return importlib.import_module("gpu_suite")


def _row(backend: str, graphs: str, bs: int, x_roofline: float, input_len: int = 512) -> dict:
    return {
        "backend": backend,
        "graphs": graphs,
        "batch_size": bs,
        "input_len": input_len,
        "prefill_ms": 10.0,
        "prefill_vs_matmul_rate": 0.7,
        "decode_step_ms": 5.0 * x_roofline,
        "decode_roofline_ms": 5.0,
        "decode_x_roofline": x_roofline,
        "decode_tok_s": bs / (5e-3 * x_roofline),
    }


def _result(**overrides: Any) -> dict[str, Any]:
    prefill = _row("triton", "off", 1, 3.0, input_len=2048) | {"prefill_vs_matmul_rate": 0.83}
    offline_rows = [
        {
            "workload": "shared-prefix",
            "radix": radix,
            "completed": 16,
            "request_throughput": 1.0,
            "input_throughput": 100.0,
            "output_throughput": 10.0,
            "total_throughput": 110.0,
            "cache_hit_rate": 0.5 if radix == "on" else 0.0,
            "floor_s": 2.0 if radix == "on" else 9.0,
            "of_floor": 0.8 if radix == "on" else 0.9,
        }
        for radix in ("on", "off")
    ]
    return {
        "date": "2026-11-22",
        "device": "GPU",
        "torch": "2.11",
        "commit": "abc1234",
        "quick": True,
        "decode_output_len": 32,
        "bandwidth_bytes_s": 3.0e12,
        "matmul_flop_s": 7.7e14,
        "one_batch": [
            _row("triton", "on", 1, 1.6),
            _row("triton", "off", 1, 4.0),
            _row("triton", "on", 64, 1.25),
        ],
        "prefill_2048": [prefill],
        "offline": {
            "rows": offline_rows,
            "radix_on_over_off": {"shared-prefix": 3.2},
            "floor_on_over_off": {"shared-prefix": 4.5},
        },
        "parity": {"tests": 6, "failures": 0, "errors": 0, "skipped": 1, "passed": 5},
        "sampling": {
            "device": "GPU",
            "rows": [
                {"bs": 64, "setting": "greedy", "path": "triton", "ms": 0.04},
                {"bs": 64, "setting": "top-p 0.9", "path": "triton", "ms": 0.25},
                {"bs": 64, "setting": "top-p 0.9", "path": "torch", "ms": 1.5},
            ],
        },
        "sampling_check": {"tests": 9, "failures": 1, "errors": 0, "skipped": 0, "passed": 8},
        "errors": [],
    } | overrides


def test_targets_take_each_backends_best_run(suite: ModuleType) -> None:
    found = {t.name: (where, figure) for t, where, figure in suite.targets(_result())}
    assert found[suite.DECODE_BS1.name] == ("triton, graphs on", 1.6)
    assert found[suite.DECODE_BS64.name] == ("triton, graphs on", pytest.approx(1 / 1.25))
    assert found[suite.PREFILL_2048.name] == ("triton", 0.83)
    assert found[suite.SHARED_PREFIX.name][1] == 3.2
    assert suite.PREFILL_2048.met(0.83) and not suite.DECODE_BS1.met(1.6)
    assert suite.DECODE_BS1.met(1.05) and not suite.DECODE_BS64.met(0.8)


def test_report_marks_targets_and_unmeasured_figures(suite: ModuleType) -> None:
    table = suite.markdown(_result())
    assert "(quick run): 2026-11-22, GPU, torch 2.11, commit abc1234" in table
    assert f"| {suite.PREFILL_2048.name} | triton | 0.83 | >= 0.8 | yes |" in table
    assert f"| {suite.DECODE_BS1.name} | triton, graphs on | 1.60 | <= 1.1 | no |" in table
    assert "| 5 passed, 0 failed, 1 skipped | all pass | yes |" in table
    assert "| 8 passed, 1 failed, 0 skipped | all pass | no |" in table
    assert "| 64 | top-p 0.9 | 0.250 | 1.500 | 6.0 |" in table
    assert "| 64 | greedy | 0.040 | n/a | n/a |" in table
    assert "| shared-prefix | on | 16 | 1.00 | 100 | 10 | 110 | 0.500 | 2.00 | 0.80 |" in table
    assert "shared-prefix: the floors' ratio (radix off over on) is 4.50x" in table
    # A failed stage: its figures are n/a and the failure is listed.
    broken = suite.markdown(_result(offline=None, sampling=None, errors=["offline: exit status 1"]))
    assert "Sampling, one" not in broken
    assert f"| {suite.SHARED_PREFIX.name} | default backend | n/a | >= 5.0 | n/a |" in broken
    assert "- offline: exit status 1" in broken
    # The engine options every stage ran with head the report when there are any.
    assert "engine options" not in table
    options = suite.markdown(_result(engine_args={"enable_sm90_prefill": True}))
    assert 'commit abc1234, engine options {"enable_sm90_prefill": true}' in options


def test_report_has_the_stack_stage_or_why_it_was_skipped(suite: ModuleType) -> None:
    stack = {
        "model": "llama-8b",
        "requests": 256,
        "prompt_len": 512,
        "output_len": 256,
        "stack_tok_s": 8795.0,
        "engine_tok_s": 8609.6,
        "throughput_ratio": 1.0215,
        "stack_stream_tok_s": 8929.7,
        "stream_throughput_ratio": 1.0372,
        "ttft_p50_stack_ms": 62.83,
        "ttft_p50_engine_ms": 43.17,
        "ttft_p50_added_ms": 19.66,
    }
    table = suite.markdown(_result(stack=stack, stack_skipped=None))
    assert "engine (llama-8b, 256 requests x 512 + 256 tokens)" in table
    assert "| tok/s, unstreamed | 8795 | 8610 | 1.02 |" in table
    assert "| tok/s, streamed | 8930 | 8610 | 1.04 |" in table
    assert "| TTFT p50 at concurrency 1, ms | 62.8 | 43.2 | +19.7 ms |" in table
    skipped = suite.markdown(_result(stack=None, stack_skipped="no nats package"))
    assert "The stack stage was skipped: no nats package." in skipped
    assert "The service stack" not in skipped


def test_report_has_the_start_up_stage(suite: ModuleType) -> None:
    rows = [
        {
            "device": "GPU",
            "backend": "auto",
            "prefill_warm_up": True,
            "layers": 4,
            "ready_s": 55.64,
            "first_ms": 106.17,
            "second_ms": 14.0,
            "grammar_warm_up_ms": 2345.6,
            "kinds": {"prompt of 5": [12.0, 10.0], "json schema": [900.0, 15.0]},
            "kernels_built": {"json schema #1": ["apply_token_bitmask_inplace_kernel"]},
        }
    ]
    table = suite.markdown(_result(start_up=rows))
    assert "| on | 55.6 | 106.2 | 14.0 | 7.6 |" in table
    assert "tokenizer information, 2346 ms" in table
    assert "| prompt of 5 | 12.0 | 10.0 | 1.2 |" in table
    assert "| json schema | 900.0 | 15.0 | 60.0 |" in table
    assert "- json schema #1: apply_token_bitmask_inplace_kernel" in table
    assert "Start-up with empty kernel caches" not in suite.markdown(_result(start_up=None))


def test_report_has_the_ttft_stage(suite: ModuleType) -> None:
    rows = [
        {
            "input_len": 128,
            "ttft_ms": 6.954,
            "steps": 2,
            "step_host_ms": [3.3, 3.5],
            "first_step_device_ms": 6.731,
            "overlap": "on",
        }
    ]
    table = suite.markdown(_result(ttft=rows))
    assert "| 128 | 6.95 | 6.73 | 2 |" in table
    assert "Time to first token" not in suite.markdown(_result(ttft=None))


def test_stack_stage_is_skipped_without_a_server_binary(
    suite: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RADIXSERVE_NATS_SERVER_BIN", str(tmp_path / "missing-nats-server"))
    reason = suite.stack_missing()
    assert reason is not None and "nats-server" in reason
    monkeypatch.delenv("RADIXSERVE_NATS_SERVER_BIN")
    assert suite.stack_missing() is None  # this machine has the packages and binaries
