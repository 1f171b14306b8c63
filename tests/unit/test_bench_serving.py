"""`radixserve bench serving` in pieces: seeded workloads, arrivals, the concurrency cap,
stream parsing for both backends, and the report's arithmetic (against numpy).
The whole command runs against a live stack in tests/integration/test_observability.py."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from typing import Any

import httpx
import numpy as np
import pytest

from radixserve.benchmark.client import RequestResult, RequestSpec, send_request, sse_data
from radixserve.benchmark.datasets import (
    TokenRange,
    expected_shared_prefix_hit_rate,
    generated_shared_prefix,
    random_requests,
    sharegpt_like_requests,
)
from radixserve.benchmark.report import render_table, summarize
from radixserve.benchmark.runner import arrival_gaps, run_requests
from radixserve.benchmark.serving import build_requests
from radixserve.cli import build_parser

# -- workloads --------------------------------------------------------------------------------


def test_random_lengths_stay_in_range_and_repeat_with_the_seed() -> None:
    tokens = TokenRange(100, 200)
    first = random_requests(random.Random(7), 50, 64, 16, range_ratio=0.5, tokens=tokens)
    again = random_requests(random.Random(7), 50, 64, 16, range_ratio=0.5, tokens=tokens)
    other = random_requests(random.Random(8), 50, 64, 16, range_ratio=0.5, tokens=tokens)
    assert first == again and first != other
    assert all(32 <= r.prompt_len <= 64 and 8 <= r.output_len <= 16 for r in first)
    assert all(100 <= t < 200 for r in first for t in r.prompt)
    exact = random_requests(random.Random(1), 5, 10, 3, range_ratio=1.0)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(10, 3)}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(random.Random(1), 5, 10, 3, range_ratio=1.5)
    with pytest.raises(ValueError, match="num-prompts"):
        random_requests(random.Random(1), 0, 10, 3)


def test_sharegpt_like_lengths_are_long_tailed_and_fit_the_context() -> None:
    requests = sharegpt_like_requests(random.Random(3), 2000, context_len=1024)
    prompts = [r.prompt_len for r in requests]
    assert all(r.prompt_len + r.output_len <= 1024 and r.prompt_len >= 4 for r in requests)
    assert 60 < statistics.median(prompts) < 160  # the fit's median is ~100
    assert max(prompts) > 4 * statistics.median(prompts)  # a long tail
    assert sharegpt_like_requests(random.Random(3), 10) == sharegpt_like_requests(
        random.Random(3), 10
    )
    assert {r.output_len for r in sharegpt_like_requests(random.Random(3), 10, output_len=7)} == {7}


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    requests = generated_shared_prefix(random.Random(5), 3, 4, 32, 6, 2)
    assert len(requests) == 12 and [r.group for r in requests] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r.prompt_len == 38 and r.output_len == 2 for r in requests)
    for group in range(3):
        members = [r.prompt for r in requests if r.group == group]
        assert all(m[:32] == members[0][:32] for m in members)
        assert len({tuple(m[32:]) for m in members}) == 4  # distinct questions
    assert requests[0].prompt[:32] != requests[4].prompt[:32]
    assert expected_shared_prefix_hit_rate(2, 8, 512, 8) == pytest.approx(
        (2 * 7 * 512) / (16 * 520)
    )


def test_cli_flags_build_the_workload() -> None:
    ns = build_parser().parse_args(
        ["bench", "serving", "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
         "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "16", "--gsp-question-len",
         "4", "--gsp-output-len", "5", "--max-concurrency", "4", "--request-rate", "2.5"]
    )  # fmt: skip
    assert (ns.command, ns.bench_command, ns.max_concurrency, ns.request_rate) == (
        "bench",
        "serving",
        4,
        2.5,
    )
    assert ns.base_url == "http://127.0.0.1:8000" and ns.backend == "openai"
    requests = build_requests(ns, random.Random(ns.seed))
    assert [(r.prompt_len, r.output_len) for r in requests] == [(20, 5)] * 6


# -- arrivals and concurrency ------------------------------------------------------------------


def test_arrivals_are_poisson_at_the_requested_rate() -> None:
    gaps = arrival_gaps(4000, 8.0, random.Random(2))
    assert gaps[0] == 0.0
    assert np.mean(gaps[1:]) == pytest.approx(1 / 8.0, rel=0.06)
    assert np.std(gaps[1:]) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: std == mean
    assert arrival_gaps(3, float("inf"), random.Random(2)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, random.Random(2))


async def test_requests_start_in_order_and_respect_the_concurrency_cap() -> None:
    specs = [RequestSpec("m", [i], 1, 1) for i in range(12)]
    started: list[int] = []
    running = 0
    peak = 0

    async def send(spec: RequestSpec) -> RequestResult:
        nonlocal running, peak
        assert isinstance(spec.prompt, list)
        started.append(spec.prompt[0])
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return RequestResult(success=True, prompt_len=1, output_tokens=1)

    results, duration = await run_requests(
        specs, send, float("inf"), 3, random.Random(0), progress=False
    )
    assert len(results) == 12 and all(r.success for r in results)
    assert started == list(range(12)) and peak == 3
    assert 0.03 <= duration < 2.0


# -- the two backends' streams (a local ASGI-free transport serving canned SSE) -----------------


def sse(*payloads: str) -> bytes:
    return "".join(f"data: {p}\n\n" for p in payloads).encode()


def test_sse_payloads_stop_at_done() -> None:
    lines = [": keep-alive", 'data: {"a": 1}', "", "data: [DONE]", 'data: {"b": 2}']
    assert list(sse_data(lines)) == [{"a": 1}]


async def test_openai_backend_reads_chunks_and_usage() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.read())
        body = sse(
            '{"choices": [{"index": 0, "text": "He", "finish_reason": null}], "usage": null}',
            '{"choices": [{"index": 0, "text": "", "finish_reason": null}], "usage": null}',
            '{"choices": [{"index": 0, "text": "llo", "finish_reason": "length"}], "usage": null}',
            '{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
            '"prompt_tokens_details": {"cached_tokens": 3}}}',
            "[DONE]",
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(handler), base_url="http://server"
    ) as http:
        result = await send_request(http, RequestSpec("m", [1, 2, 3, 4, 5], 5, 2), "openai")
    assert seen["path"] == "/v1/completions"
    assert seen["body"] == {
        "model": "m",
        "prompt": [1, 2, 3, 4, 5],
        "max_tokens": 2,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    assert result.success and result.error == ""
    assert (result.prompt_len, result.output_tokens, result.cached_tokens) == (5, 2, 3)
    assert len(result.itl) == 1 and 0 < result.ttft <= result.latency


async def test_native_backend_reads_cumulative_events_and_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if b"fail" in request.read():
            return httpx.Response(429, json={"error": {"message": "queue full"}})
        meta = '"meta_info": {{"prompt_tokens": 3, "completion_tokens": {n}, "cached_tokens": 1}}'
        body = sse(
            '{"text": "a", "output_ids": [9], ' + meta.format(n=1) + "}",
            '{"text": "ab", "output_ids": [9, 8], ' + meta.format(n=2) + "}",
            '{"text": "abc", "output_ids": [9, 8, 7], ' + meta.format(n=3) + "}",
            "[DONE]",
        )
        return httpx.Response(200, content=body)

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(handler), base_url="http://server"
    ) as http:
        ok = await send_request(http, RequestSpec("m", "hello", 3, 3), "radixserve")
        failed = await send_request(http, RequestSpec("m", "fail", 3, 3), "radixserve")
    assert ok.success and (ok.output_tokens, ok.cached_tokens, len(ok.itl)) == (3, 1, 2)
    assert not failed.success and "429" in failed.error


# -- the report ---------------------------------------------------------------------------------


def test_summary_matches_numpy_and_counts_cache_hits() -> None:
    results = [
        RequestResult(True, 100, 10, 80, ttft=0.1, latency=1.0, itl=[0.1] * 9),
        RequestResult(True, 200, 5, 0, ttft=0.3, latency=0.7, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(True, 50, 1, None, ttft=0.2, latency=0.2),  # did not report cached
        RequestResult(False, 70, error="HTTP 503: no worker"),
    ]
    summary = summarize(results, 2.0, {"backend": "openai", "dataset_name": "random"})
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["total_input_tokens"] == 350 and summary["total_output_tokens"] == 16
    assert summary["request_throughput"] == 1.5 and summary["output_throughput"] == 8.0
    assert summary["cache_hit_rate"] == pytest.approx(80 / 300)
    ttft_ms = np.array([100.0, 300.0, 200.0])
    assert summary["mean_ttft_ms"] == pytest.approx(ttft_ms.mean())
    assert summary["p99_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 99))
    tpot_ms = [(1.0 - 0.1) / 9 * 1000, (0.7 - 0.3) / 4 * 1000]  # one-token requests excluded
    assert summary["median_tpot_ms"] == pytest.approx(np.median(tpot_ms))
    assert summary["mean_itl_ms"] == pytest.approx(100.0)
    assert summary["p90_e2e_latency_ms"] == pytest.approx(np.percentile([1000, 700, 200], 90))
    assert summary["errors"] == ["HTTP 503: no worker"]
    table = render_table(summary)
    assert "Cache hit rate:" in table and "0.267" in table and "Failed requests:" in table
    assert summarize([], 1.0, {})["cache_hit_rate"] is None


def test_goodput_counts_the_requests_meeting_every_objective() -> None:
    results = [
        RequestResult(True, 10, 21, ttft=0.030, latency=0.210),  # TPOT 9 ms, e2e 210 ms
        RequestResult(True, 10, 2, ttft=0.060, latency=0.300),  # TTFT 60, TPOT 240
        RequestResult(True, 10, 31, ttft=0.020, latency=0.620),  # TPOT 20, e2e 620
        RequestResult(True, 10, 1, ttft=0.045, latency=0.045),  # one token: TPOT 0
        RequestResult(False, 10, error="HTTP 500"),  # never good
    ]
    by_hand = {  # the good requests, by which objectives are given
        (("ttft", 50.0), ("tpot", 10.0), ("e2el", 500.0)): 2,  # the first and the fourth
        (("ttft", 50.0),): 3,
        (("tpot", 10.0),): 2,
        (("e2el", 500.0),): 3,
        (("ttft", 10.0),): 0,
    }
    for slos, good in by_hand.items():
        summary = summarize(results, 2.0, {}, dict(slos))
        assert summary["good_completed"] == good and summary["request_goodput"] == good / 2.0
        assert summary["goodput_slos_ms"] == dict(slos)
    none = summarize(results, 2.0, {})
    assert none["request_goodput"] is None and "goodput" not in render_table(none)
    assert "Request goodput (req/s):" in render_table(summarize(results, 2.0, {}, {"ttft": 50}))


def test_goodput_flag_takes_vllms_spelling() -> None:
    ns = build_parser().parse_args(["bench", "serving", "--goodput", "ttft:50", "e2el:1500.5"])
    assert ns.goodput == [("ttft", 50.0), ("e2el", 1500.5)]
    assert build_parser().parse_args(["bench", "serving"]).goodput is None
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serving", "--goodput", bad])


# SGLang's bench_serving result keys, then vLLM's bench serve's, that the summary carries.
SGLANG_KEYS = (
    "duration completed total_input_tokens total_output_tokens request_throughput "
    "input_throughput output_throughput total_throughput concurrency mean_e2e_latency_ms "
    "median_e2e_latency_ms std_e2e_latency_ms p99_e2e_latency_ms mean_ttft_ms median_ttft_ms "
    "std_ttft_ms p99_ttft_ms mean_tpot_ms median_tpot_ms std_tpot_ms p99_tpot_ms mean_itl_ms "
    "median_itl_ms std_itl_ms p95_itl_ms p99_itl_ms max_itl_ms"
).split()
VLLM_KEYS = (
    "duration completed total_input_tokens total_output_tokens request_throughput "
    "request_goodput output_throughput total_token_throughput mean_ttft_ms median_ttft_ms "
    "std_ttft_ms p50_ttft_ms p99_ttft_ms mean_tpot_ms median_tpot_ms std_tpot_ms p50_tpot_ms "
    "p99_tpot_ms mean_itl_ms median_itl_ms std_itl_ms p50_itl_ms p99_itl_ms mean_e2el_ms "
    "median_e2el_ms std_e2el_ms p50_e2el_ms p99_e2el_ms"
).split()


def test_summary_carries_sglangs_and_vllms_result_keys() -> None:
    results = [
        RequestResult(True, 8, 4, ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1]),
        RequestResult(True, 8, 3, ttft=0.2, latency=0.6, itl=[0.2, 0.2]),
    ]
    summary = summarize(results, 1.0, {}, {"ttft": 150.0})
    assert set(SGLANG_KEYS + VLLM_KEYS) <= set(summary)
    e2e_ms = np.array([400.0, 600.0])
    for stat, value in (
        ("mean", e2e_ms.mean()),
        ("std", e2e_ms.std()),
        ("p99", np.percentile(e2e_ms, 99)),
    ):
        assert (
            summary[f"{stat}_e2el_ms"] == summary[f"{stat}_e2e_latency_ms"] == pytest.approx(value)
        )
    assert summary["p50_ttft_ms"] == summary["median_ttft_ms"] == pytest.approx(150.0)
    assert summary["max_itl_ms"] == pytest.approx(200.0) and summary[
        "concurrency"
    ] == pytest.approx(1.0)
    assert summary["total_token_throughput"] == summary["total_throughput"] == 23.0
    assert summary["request_goodput"] == 1.0  # the first request's TTFT is within 150 ms
    json.dumps(summary)  # the --output-file line
