"""Metrics: per-process registries, the gateway's and the worker's counters, the /metrics
port, the settings that switch it on, and the stack's port plan."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from radixserve import protocol
from radixserve.bus import BusNoResponders, BusTimeout
from radixserve.engine.kvcache.hiradix_cache import HostCacheStats
from radixserve.services.runtime import (
    ServiceSettings,
    add_common_arguments,
    settings_from_args,
)
from radixserve.stack import StackSpec
from radixserve.telemetry.buckets import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from radixserve.telemetry.common import CONTENT_TYPE, ServiceMetrics
from radixserve.telemetry.exposition import MetricsServer
from radixserve.telemetry.latency import TokenTimes
from radixserve.telemetry.metrics import GatewayMetrics
from radixserve.worker.metrics import HitRateWindow, WorkerMetrics, WorkerTelemetry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# -- buckets and registries ------------------------------------------------------------------


def test_latency_buckets_are_the_opentelemetry_genai_ones() -> None:
    # gen_ai.server.time_to_first_token / request.duration / time_per_output_token
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 10.0
    assert len(TTFT_BUCKETS) == 16
    assert len(E2E_BUCKETS) == 14
    assert all(abs(b - 0.01 * 2**k) < 1e-9 for k, b in enumerate(E2E_BUCKETS))
    assert TPOT_BUCKETS == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
    le = sorted(
        {
            s.labels["le"]
            for f in GatewayMetrics().registry.collect()
            if f.name == "radixserve:time_to_first_token_seconds"
            for s in f.samples
            if "le" in s.labels
        },
        key=float,
    )
    assert [float(x) for x in le[:-1]] == list(TTFT_BUCKETS) and le[-1] == "+Inf"


def test_every_process_has_its_own_registry() -> None:
    first, second = ServiceMetrics("tokenizer", "t-0"), ServiceMetrics("tokenizer", "t-1")
    GatewayMetrics(common=first)
    GatewayMetrics(common=second)  # the same names again: no clash
    first.nats_request_duration.labels(operation="x", outcome="ok").observe(0.1)
    assert (
        sample(
            second.registry,
            "radixserve:nats_request_duration_seconds_count",
            operation="x",
            outcome="ok",
        )
        is None
    )
    assert (
        sample(first.registry, "radixserve:service_info", service="tokenizer", instance="t-0") == 1
    )
    assert b"process_cpu_seconds_total" in first.render()


async def test_round_trips_are_timed_by_outcome() -> None:
    common = ServiceMetrics("scheduler", "s-0")

    async def fail(exc: Exception) -> None:
        with common.time_nats("worker.flush_cache"):
            raise exc

    with common.time_nats("worker.flush_cache"):
        pass
    with pytest.raises(BusTimeout):
        await fail(BusTimeout("subject", 1.0))
    with pytest.raises(BusNoResponders):
        await fail(BusNoResponders("subject"))
    with pytest.raises(RuntimeError):
        await fail(RuntimeError("boom"))
    with common.time_redis("put_request"):
        time.sleep(0.002)
    name = "radixserve:nats_request_duration_seconds_count"
    for outcome in ("ok", "timeout", "no_responders", "error"):
        got = sample(common.registry, name, operation="worker.flush_cache", outcome=outcome)
        assert got == 1, outcome
    redis_sum = sample(
        common.registry,
        "radixserve:redis_request_duration_seconds_sum",
        operation="put_request",
        outcome="ok",
    )
    assert redis_sum is not None and redis_sum >= 0.002


# -- the gateway ---------------------------------------------------------------------------


def test_gateway_counts_tokens_finish_reasons_and_errors() -> None:
    metrics = GatewayMetrics()
    r = metrics.registry
    metrics.observe_request(
        status=200,
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=4,
        e2e_s=1.0,
        ttft_s=0.2,
        max_choice_tokens=5,
        finish_reasons=["stop", "length"],
    )
    metrics.observe_request(status=429, error_type="rate_limit_error", error_code="queue_full")
    metrics.observe_request(status=499)  # the client left: no error type
    assert sample(r, "radixserve:prompt_tokens_total") == 10
    assert sample(r, "radixserve:generation_tokens_total") == 5
    assert sample(r, "radixserve:cached_tokens_total") == 4
    assert sample(r, "radixserve:finished_requests_total", finish_reason="stop") == 1
    assert sample(r, "radixserve:finished_requests_total", finish_reason="length") == 1
    assert sample(r, "radixserve:requests_total", status="429") == 1
    assert sample(r, "radixserve:requests_total", status="499") == 1
    assert (
        sample(
            r, "radixserve:request_errors_total", error_type="rate_limit_error", code="queue_full"
        )
        == 1
    )
    assert sample(r, "radixserve:time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert sample(r, "radixserve:e2e_request_latency_seconds_count") == 1
    metrics.observe_inter_token(0.05, 3)
    assert sample(r, "radixserve:inter_token_latency_seconds_count") == 3
    assert sample(r, "radixserve:inter_token_latency_seconds_sum") == pytest.approx(0.15)


def test_token_times_give_ttft_once_and_a_gap_per_token() -> None:
    times = TokenTimes(started=10.0)
    assert times.on_tokens(("r", 0), 1, 10.5) == (0.5, None)
    assert times.on_tokens(("r", 1), 1, 10.6) == (None, None)  # another choice's first
    ttft, gap = times.on_tokens(("r", 0), 2, 10.9)
    assert ttft is None and gap == pytest.approx(0.2)
    assert times.on_tokens(("r", 0), 0, 11.0) == (None, None)  # text held back, no ids
    assert times.first_token_at == 10.5


# -- the worker ----------------------------------------------------------------------------


def routed(rid: str, prompt: int = 10, n: int = 1) -> protocol.RoutedRequest:
    request = protocol.TokenizedRequest(
        rid=rid,
        gateway_id="g",
        input_ids=protocol.pack_tokens(list(range(100, 100 + prompt))),
        sampling=protocol.SamplingParams(max_new_tokens=3, n=n),
    )
    return protocol.RoutedRequest(request=request, worker_id="w-0")


def output(
    rid: str,
    tokens: list[int],
    completion: int,
    *,
    first: bool = False,
    finish: str = "",
    cached: int = 4,
    index: int = 0,
) -> protocol.StepOutput:
    return protocol.StepOutput(
        rid=rid,
        gateway_id="g",
        new_token_ids=protocol.pack_tokens(tokens),
        index=index,
        finish_reason=protocol.FinishReason(kind=finish) if finish else None,  # type: ignore[arg-type]
        prompt_tokens=10,
        completion_tokens=completion,
        cached_tokens=cached,
        detok=protocol.DetokParams() if first else None,
    )


def test_worker_counters_are_the_sums_of_its_step_outputs() -> None:
    common = ServiceMetrics("worker", "w-0")
    telemetry = WorkerTelemetry(WorkerMetrics(common, "w-0"), TracerProvider().get_tracer("t"))
    r, w = common.registry, {"worker": "w-0"}
    telemetry.received(routed("a"))
    telemetry.received(routed("b", n=2))
    started = time.perf_counter()
    telemetry.observe_step(
        started,
        0.01,
        3,
        [
            output("a", [7], 1, first=True),
            output("b", [8], 1, first=True, index=0),
            output("b", [9], 1, first=True, index=1),
        ],
    )
    telemetry.observe_step(
        started,
        0.02,
        3,
        [
            output("a", [7, 7], 3, finish="length"),
            output("b", [8], 2, finish="stop", index=0, cached=10),
            output("b", [], 1, finish="abort", index=1, cached=10),
        ],
    )
    assert sample(r, "radixserve:generation_tokens_total", **w) == 6
    assert sample(r, "radixserve:prompt_tokens_total", **w) == 20  # once per request
    assert sample(r, "radixserve:cache_query_tokens_total", **w) == 30  # once per choice
    assert sample(r, "radixserve:cache_hit_tokens_total", **w) == 24
    for reason in ("length", "stop", "abort"):
        assert sample(r, "radixserve:finished_requests_total", finish_reason=reason, **w) == 1
    assert sample(r, "radixserve:request_queue_time_seconds_count", **w) == 2  # per request
    assert sample(r, "radixserve:step_duration_seconds_count", **w) == 2
    assert sample(r, "radixserve:step_duration_seconds_sum", **w) == pytest.approx(0.03)
    assert sample(r, "radixserve:batch_size_sum", **w) == 6

    # An abort answered before the request reached the engine (no step): counted too.
    telemetry.observe_outputs(time.perf_counter(), [output("c", [], 0, finish="abort", cached=0)])
    assert sample(r, "radixserve:finished_requests_total", finish_reason="abort", **w) == 2
    assert sample(r, "radixserve:prompt_tokens_total", **w) == 30
    assert sample(r, "radixserve:cache_query_tokens_total", **w) == 40
    assert sample(r, "radixserve:generation_tokens_total", **w) == 6

    kv = SimpleNamespace(used_tokens=25, pool_size=100)
    passes = {"decode_graph": 7, "prefill_pieces": 2, "eager": 1}
    load = SimpleNamespace(
        num_running_reqs=2,
        num_queue_reqs=1,
        kv=kv,
        forward_passes=passes,
        device_wait_seconds=1.5,
        host_cache=None,
    )
    assert telemetry.observe_load(load) == pytest.approx(24 / 40)  # type: ignore[arg-type]
    assert sample(r, "radixserve:token_usage", **w) == 0.25
    # The engine's pass totals: the counter follows them from tick to tick.
    assert sample(r, "radixserve:forward_passes_total", kind="decode_graph", **w) == 7
    assert sample(r, "radixserve:step_device_wait_seconds_total", **w) == 1.5
    load.forward_passes = {"decode_graph": 10, "prefill_pieces": 2, "eager": 4}
    load.device_wait_seconds = 2.25
    telemetry.observe_load(load)  # type: ignore[arg-type]
    for kind, total in load.forward_passes.items():
        assert sample(r, "radixserve:forward_passes_total", kind=kind, **w) == total
    assert sample(r, "radixserve:step_device_wait_seconds_total", **w) == 2.25
    assert sample(r, "radixserve:num_queue_reqs", **w) == 1
    assert sample(r, "radixserve:cache_hit_rate", **w) == pytest.approx(0.6)
    assert sample(r, "radixserve:cache_tier_usage", tier="host", **w) is None
    # HiCache's host tier: totals from the engine, counters that follow them.
    for loaded in (100, 160):
        load.host_cache = HostCacheStats(
            host_size_tokens=1000,
            host_used_tokens=250,
            bytes_per_token=64,
            loaded_tokens=loaded,
            written_tokens=300,
            dropped_tokens=20,
            load_seconds=loaded / 1000,
            write_seconds=0.5,
            store_loaded_tokens=loaded // 2,
        )
        telemetry.observe_load(load)  # type: ignore[arg-type]
    host = {"tier": "host", **w}
    assert sample(r, "radixserve:cache_tier_tokens_total", direction="load", **host) == 160
    assert sample(r, "radixserve:cache_tier_tokens_total", direction="write", **host) == 300
    assert sample(r, "radixserve:cache_tier_tokens_total", direction="drop", **host) == 20
    assert sample(r, "radixserve:cache_tier_bytes_total", direction="load", **host) == 160 * 64
    assert sample(r, "radixserve:cache_tier_seconds_total", direction="load", **host) == (
        pytest.approx(0.16)
    )
    assert sample(r, "radixserve:cache_tier_usage", **host) == 0.25
    store = {"tier": "store", "direction": "load", **w}
    assert sample(r, "radixserve:cache_tier_tokens_total", **store) == 80
    telemetry.metrics.set_cache_config(page_size=16, num_pages=512)
    assert sample(r, "radixserve:cache_config_info", page_size="16", num_pages="512", **w) == 1


def test_hit_rate_window_covers_the_prompts_since_the_last_tick() -> None:
    window = HitRateWindow()
    assert window.update(0, 0) == 0.0
    assert window.update(30, 100) == 0.3
    assert window.update(30, 100) == 0.3  # nothing new: the last value stays
    assert window.update(130, 200) == 1.0


# -- the /metrics port and its settings -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metrics_port_serves_the_process_registry() -> None:
    common = ServiceMetrics("detokenizer", "d-0")
    server = MetricsServer.start(common.registry, "127.0.0.1", free_port())
    try:
        response = httpx.get(server.url, timeout=5.0)
        assert response.status_code == 200
        assert 'radixserve:service_info{instance="d-0",service="detokenizer"} 1.0' in response.text
        with pytest.raises(OSError):  # a busy port fails the start at once
            MetricsServer.start(common.registry, "127.0.0.1", server.port)
    finally:
        server.close()
    with pytest.raises(ValueError):
        MetricsServer.start(common.registry, "127.0.0.1", 0)


# What Prometheus 2.x (2.42, 2.55) and 3.x send when they scrape.
SCRAPER_ACCEPT = {
    "prometheus-2.42": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "prometheus-2.55": "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "prometheus-3": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "none": "",
}


def test_metrics_port_serves_one_format_whatever_the_scraper_accepts() -> None:
    common = ServiceMetrics("worker", "w-0")
    server = MetricsServer.start(common.registry, "127.0.0.1", free_port())
    try:
        answers = {
            name: httpx.get(server.url, headers={"Accept": accept} if accept else {}, timeout=5.0)
            for name, accept in SCRAPER_ACCEPT.items()
        }
    finally:
        server.close()
    expected = common.render().decode()
    for name, answer in answers.items():
        assert answer.headers["content-type"] == CONTENT_TYPE, name
        # The documented names (colons kept): the same text for every scraper.
        assert 'radixserve:service_info{instance="w-0",service="worker"} 1.0' in answer.text, name
        assert "radixserve_service_info" not in answer.text, name
        lines = [line for line in answer.text.splitlines() if not line.startswith("process_")]
        assert lines == [line for line in expected.splitlines() if not line.startswith("process_")]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    return parser.parse_args(argv)


def test_metrics_port_and_otlp_endpoint_come_from_flags_then_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RADIXSERVE_METRICS_PORT", "RADIXSERVE_METRICS_HOST", "RADIXSERVE_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert settings_from_args("worker", parse([])).metrics_port == 0  # off by default
    monkeypatch.setenv("RADIXSERVE_METRICS_PORT", "9101")
    monkeypatch.setenv("RADIXSERVE_METRICS_HOST", "0.0.0.0")
    settings = settings_from_args("worker", parse([]))
    assert (settings.metrics_port, settings.metrics_host) == (9101, "0.0.0.0")
    assert settings_from_args("worker", parse(["--metrics-port", "9200"])).metrics_port == 9200
    monkeypatch.setenv("RADIXSERVE_METRICS_PORT", "ninety")
    with pytest.raises(ValueError, match="RADIXSERVE_METRICS_PORT"):
        settings_from_args("worker", parse([]))
    with pytest.raises(ValueError, match="metrics-port"):
        ServiceSettings(service="worker", metrics_port=70000)
    monkeypatch.delenv("RADIXSERVE_METRICS_PORT")
    traced = settings_from_args("worker", parse(["--otlp-endpoint", "http://collector:4318"]))
    tracing = traced.tracing_settings({})
    assert tracing.enabled and tracing.endpoint == "http://collector:4318/v1/traces"
    assert not settings_from_args("worker", parse([])).tracing_settings({}).enabled


def test_stack_gives_every_instance_but_the_gateway_its_own_metrics_port(tmp_path: Path) -> None:
    spec = StackSpec(
        nats_url="nats://x",
        redis_url="redis://x",
        subject_prefix="p",
        host="127.0.0.1",
        port=8000,
        workers=2,
        model_dir=tmp_path,
        served_model_name="m",
        worker_args=[],
        tokenizer_args=[],
        log_dir=tmp_path,
        metrics_port_base=9100,
    )
    assert spec.metrics_ports() == {
        "detokenizer-0": 9100,
        "grammar-0": 9101,
        "scheduler-0": 9102,
        "tokenizer-0": 9103,
        "worker-0": 9104,
        "worker-1": 9105,
    }
    assert StackSpec(**{**spec.__dict__, "metrics_port_base": 0}).metrics_ports() == {}
