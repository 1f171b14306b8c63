"""Observability through the whole stack: metrics on every service, one trace per request,
dashboards that name only exported metrics, and `radixserve bench serving`.

One stack for the module: real NATS and Redis, the six services as processes (the
code `radixserve up` runs) with a /metrics port each and traces exported over OTLP/HTTP
(JSON) to a receiver in this process. A tiny random-weight Llama with the SmolLM2
tokenizer. The references are the HTTP answers themselves: every counter's increase
must equal what the responses' `usage` and `finish_reason` add up to.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.infra.servers import free_port_block
from radixserve.stack import Stack, StackSpec
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.test_telemetry_dashboards import dashboard_metric_names

pytestmark = pytest.mark.timeout(240)

SERVICES = ("gateway", "tokenizer", "grammar", "scheduler", "worker", "detokenizer")
WORKER = "worker-0"
CONTEXT = 4096


# -- an OTLP/HTTP (JSON) receiver ----------------------------------------------------------


class OtlpReceiver:
    """Collects the spans POSTed to `/v1/traces`, flattened with their service name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.raw: list[bytes] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status = 200
                try:
                    receiver._add(body)
                except (ValueError, KeyError):
                    status = 400
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, body: bytes) -> None:
        request = json.loads(body)
        spans = []
        for resource_spans in request["resourceSpans"]:
            resource = attributes_of(resource_spans["resource"].get("attributes", []))
            for scope_spans in resource_spans["scopeSpans"]:
                for span in scope_spans["spans"]:
                    spans.append(
                        {
                            **span,
                            "service": resource.get("service.name"),
                            "attrs": attributes_of(span.get("attributes", [])),
                            "event_names": [e["name"] for e in span.get("events", [])],
                        }
                    )
        with self._lock:
            self.raw.append(body)
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["traceId"] == trace_id]

    def find(self, **attrs: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if all(s["attrs"].get(k) == v for k, v in attrs.items())]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def any_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    raise ValueError(f"unknown OTLP value {value}")


def attributes_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {item["key"]: any_value(item["value"]) for item in items}


# -- the stack --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    url: str
    metrics_urls: dict[str, str]  # service -> its /metrics URL
    receiver: OtlpReceiver
    model_dir: Path


@pytest.fixture(scope="module")
def observed(
    nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Observed]:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("obs_model"), seed=0)
    receiver = OtlpReceiver()
    context = ["--context-length", str(CONTEXT)]
    spec = StackSpec(
        nats_url=nats_url,
        redis_url=redis_url,
        subject_prefix=f"o{uuid.uuid4().hex[:8]}",
        host="127.0.0.1",
        port=free_port_block(1),
        workers=1,
        model_dir=model_dir,
        served_model_name="test-model",
        worker_args=["--device", "cpu", "--max-total-tokens", "16384", *context],
        tokenizer_args=context,
        log_dir=tmp_path_factory.mktemp("obs_logs"),
        extra_args={"grammar": ["--model", str(model_dir)]},
        metrics_port_base=free_port_block(5),
    )
    stack = Stack(spec, say=print)
    with pytest.MonkeyPatch.context() as env:
        # The children inherit these: traces as OTLP/HTTP JSON to the receiver, quickly.
        env.setenv("RADIXSERVE_OTLP_ENDPOINT", receiver.url)
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        env.delenv("OTEL_TRACES_EXPORTER", raising=False)
        stack.start()
    try:
        stack.wait_healthy(150.0)
        urls = {"gateway": f"{spec.url}/metrics"}
        for instance, port in spec.metrics_ports().items():
            urls[instance.rsplit("-", 1)[0]] = f"http://127.0.0.1:{port}/metrics"
        yield Observed(spec.url, urls, receiver, model_dir)
    finally:
        stack.stop()
        receiver.close()


# -- scraping -------------------------------------------------------------------------------


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[Samples, set[str]]:
    """(sample name + labels -> value, every family name declared)."""
    text = httpx.get(url, timeout=5.0).text
    samples: Samples = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, families


def scrape_all(observed: Observed) -> dict[str, Samples]:
    return {service: scrape(url)[0] for service, url in observed.metrics_urls.items()}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# -- the tests -------------------------------------------------------------------------------


FORWARD_PASSES = "radixserve:forward_passes_total"
DEVICE_WAIT = "radixserve:step_device_wait_seconds_total"


def completion(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/v1/completions", json={"model": "test-model", **body}, timeout=60.0
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def streamed_completion(url: str, **body: Any) -> dict[str, Any]:
    """The stream's usage chunk and finish reason, like a non-streamed answer."""
    usage: dict[str, Any] = {}
    finish = None
    payload = {"model": "test-model", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**payload, **body}, timeout=60.0
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"usage": usage, "choices": [{"finish_reason": finish}]}


def test_every_service_counts_what_the_responses_add_up_to(observed: Observed) -> None:
    url = observed.url
    # A greedy first token, to end a request with finish reason "stop" on purpose.
    probe = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": [1500, 1600, 1700],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        timeout=60.0,
    ).json()
    first_token = probe["output_ids"][0]
    before = scrape_all(observed)

    prompt = list(range(2000, 2040))
    answers = [
        completion(url, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True),
        completion(url, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True),  # cached
        completion(
            url,
            prompt=[1500, 1600, 1700],
            max_tokens=8,
            temperature=0,
            stop_token_ids=[first_token],
        ),
        streamed_completion(url, prompt=prompt[:20], max_tokens=5, ignore_eos=True),
    ]
    bad = httpx.post(
        f"{url}/v1/completions", json={"model": "test-model", "prompt": "x", "temperature": -1}
    )
    assert bad.status_code == 400
    assert httpx.post(f"{url}/flush_cache", timeout=30.0).status_code == 200
    after = scrape_all(observed)

    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion_tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    reasons = Counter(a["choices"][0]["finish_reason"] for a in answers)
    assert reasons == {"length": 3, "stop": 1}
    assert cached >= 40  # the second request found the first one's prompt in the cache
    n = len(answers)

    g0, g1 = before["gateway"], after["gateway"]
    assert delta(g0, g1, "radixserve:prompt_tokens_total") == prompt_tokens
    assert delta(g0, g1, "radixserve:generation_tokens_total") == completion_tokens
    assert delta(g0, g1, "radixserve:cached_tokens_total") == cached
    assert delta(g0, g1, "radixserve:requests_total", status="200") == n
    assert delta(g0, g1, "radixserve:requests_total", status="400") == 1
    assert (
        delta(
            g0,
            g1,
            "radixserve:request_errors_total",
            error_type="invalid_request_error",
            code="invalid_request_error",
        )
        == 1
    )
    for reason, count in reasons.items():
        assert delta(g0, g1, "radixserve:finished_requests_total", finish_reason=reason) == count
    assert delta(g0, g1, "radixserve:time_to_first_token_seconds_count") == n
    assert delta(g0, g1, "radixserve:e2e_request_latency_seconds_count") == n
    multi_token = sum(1 for a in answers if a["usage"]["completion_tokens"] > 1)
    assert delta(g0, g1, "radixserve:time_per_output_token_seconds_count") == multi_token
    # One observation per token after the first delta of a choice.
    itl = delta(g0, g1, "radixserve:inter_token_latency_seconds_count")
    assert 0 < itl <= completion_tokens - n
    flush = {"operation": "flush_cache", "outcome": "ok"}
    assert delta(g0, g1, "radixserve:nats_request_duration_seconds_count", **flush) == 1
    writes = {"operation": "update_request", "outcome": "ok"}
    assert delta(g0, g1, "radixserve:redis_request_duration_seconds_count", **writes) >= 1

    w0, w1 = before["worker"], after["worker"]
    w = {"worker": WORKER}
    assert delta(w0, w1, "radixserve:prompt_tokens_total", **w) == prompt_tokens
    assert delta(w0, w1, "radixserve:generation_tokens_total", **w) == completion_tokens
    assert delta(w0, w1, "radixserve:cache_query_tokens_total", **w) == prompt_tokens
    assert delta(w0, w1, "radixserve:cache_hit_tokens_total", **w) == cached
    for reason, count in reasons.items():
        got = delta(w0, w1, "radixserve:finished_requests_total", finish_reason=reason, **w)
        assert got == count
    assert delta(w0, w1, "radixserve:request_queue_time_seconds_count", **w) == n
    assert delta(w0, w1, "radixserve:step_duration_seconds_count", **w) >= completion_tokens / n
    assert delta(w0, w1, "radixserve:batch_size_count", **w) >= 1
    assert delta(w0, w1, "radixserve:batch_size_sum", **w) == completion_tokens
    pool = [k for k in w1 if k[0] == "radixserve:cache_config_info"]
    assert len(pool) == 1 and dict(pool[0][1])["page_size"] == "1" and w1[pool[0]] == 1
    # Set once, when the worker got ready: it loaded a model, which takes some time.
    start = [k for k in w1 if k[0] == "radixserve:worker_start_seconds"]
    assert len(start) == 1 and dict(start[0][1]) == w and 0 < w1[start[0]] < 600
    assert w0[start[0]] == w1[start[0]]
    # Forward passes by kind, from the engine's totals at each stats tick (1 s): on the
    # CPU every pass is eager (graphs and pieces are CUDA's), at least one a step.
    eager = {"kind": "eager", **w}
    deadline = time.monotonic() + 10
    while True:
        latest = scrape(observed.metrics_urls["worker"])[0]
        passes = delta(w0, latest, FORWARD_PASSES, **eager)
        if passes >= completion_tokens / n or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert passes >= completion_tokens / n
    for kind in ("decode_graph", "prefill_pieces"):
        assert value(w1, FORWARD_PASSES, kind=kind, **w) == 0
    # The steps' waits for the device, from the same ticks: part of the steps' time.
    assert (DEVICE_WAIT, frozenset(w.items())) in latest
    waited = delta(w0, latest, DEVICE_WAIT, **w)
    assert 0 <= waited <= delta(w0, latest, "radixserve:step_duration_seconds_sum", **w)

    t0, t1 = before["tokenizer"], after["tokenizer"]
    assert delta(t0, t1, "radixserve:tokenizer_prompt_tokens_total") == prompt_tokens
    assert delta(t0, t1, "radixserve:tokenizer_requests_total", outcome="ok") == n
    assert delta(t0, t1, "radixserve:tokenize_duration_seconds_count") == n

    s0, s1 = before["scheduler"], after["scheduler"]
    assert delta(s0, s1, "radixserve:scheduler_routed_requests_total", worker=WORKER) == n
    flush_worker = {"operation": "worker.flush_cache", "outcome": "ok"}
    assert delta(s0, s1, "radixserve:nats_request_duration_seconds_count", **flush_worker) == 1

    d0, d1 = before["detokenizer"], after["detokenizer"]
    assert delta(d0, d1, "radixserve:detokenizer_tokens_total") == completion_tokens
    assert delta(d0, d1, "radixserve:detokenize_duration_seconds_count") >= 1

    for service in SERVICES:
        info = [k for k in after[service] if k[0] == "radixserve:service_info"]
        assert [dict(k[1])["service"] for k in info] == [service]


def test_dashboards_query_only_metrics_the_stack_exports(observed: Observed) -> None:
    exported: set[str] = set()
    for url in observed.metrics_urls.values():
        exported |= scrape(url)[1]
    # A family is declared (HELP/TYPE) even before its first labelled sample.
    names = {n.removesuffix("_total") for n in exported} | exported
    missing = {
        name for name in dashboard_metric_names() if name not in names and _base(name) not in names
    }
    assert not missing, f"dashboards query metrics no service exports: {sorted(missing)}"


def _base(sample_name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name


def test_one_request_is_one_trace_across_the_six_services(observed: Observed) -> None:
    secret = f"zebra-quokka-{uuid.uuid4().hex[:6]}"
    response = httpx.post(
        f"{observed.url}/v1/chat/completions",
        json={
            "model": "test-model",
            "messages": [{"role": "user", "content": f"say {secret}"}],
            "max_tokens": 4,
            "temperature": 0,
            "regex": "[a-z]{2,8}",
        },
        headers={"X-Test": "trace"},
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    answer = response.json()

    deadline = time.monotonic() + 15.0
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        roots = observed.receiver.find(**{"gen_ai.response.id": answer["id"]})
        if roots:
            spans = observed.receiver.trace(roots[0]["traceId"])
            if {s["service"] for s in spans} >= {f"radixserve-{s}" for s in SERVICES}:
                break
        time.sleep(0.1)
    # The grammar service has two spans when the worker fetches the compiled grammar.
    by_service = {
        s["service"].removeprefix("radixserve-"): s
        for s in spans
        if s["name"] != "radixserve.grammar.fetch"
    }
    assert set(by_service) >= set(SERVICES), sorted(by_service)
    assert Counter(s["service"] for s in spans)["radixserve-gateway"] == 1

    ids = {s["spanId"]: s for s in spans}
    roots = [s for s in spans if s.get("parentSpanId") not in ids]
    assert [r["service"] for r in roots] == ["radixserve-gateway"]
    gateway = by_service["gateway"]
    assert "parentSpanId" not in gateway  # a root: the client sent no traceparent

    def parent_of(service: str) -> str:
        return str(ids[by_service[service]["parentSpanId"]]["service"]).removeprefix("radixserve-")

    assert parent_of("tokenizer") == "gateway"
    assert parent_of("grammar") == "tokenizer"
    assert parent_of("scheduler") == "tokenizer"
    assert parent_of("worker") == "scheduler"
    assert parent_of("detokenizer") == "worker"
    assert by_service["grammar"]["name"] == "radixserve.grammar.compile"
    for fetch in [s for s in spans if s["name"] == "radixserve.grammar.fetch"]:
        assert ids[fetch["parentSpanId"]]["service"] == "radixserve-worker"

    usage = answer["usage"]
    attrs = gateway["attrs"]
    assert gateway["name"] == "chat test-model"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "test-model"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert (
        attrs["gen_ai.usage.cache_read.input_tokens"]
        == (usage["prompt_tokens_details"]["cached_tokens"])
    )
    assert attrs["gen_ai.response.finish_reasons"] == [answer["choices"][0]["finish_reason"]]
    assert "gen_ai.first_token" in gateway["event_names"]
    worker = by_service["worker"]
    assert worker["attrs"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert worker["attrs"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert worker["attrs"]["radixserve.worker.id"] == WORKER
    assert {"radixserve.queued", "radixserve.scheduled", "gen_ai.first_token"} <= set(
        worker["event_names"]
    )
    assert (
        by_service["detokenizer"]["attrs"]["gen_ai.usage.output_tokens"]
        == (usage["completion_tokens"])
    )
    # No prompt (nor completion) text anywhere in what was exported.
    exported = b"".join(observed.receiver.raw).decode()
    assert secret not in exported
    text = answer["choices"][0]["message"]["content"]
    assert not text or json.dumps(text) not in exported


def test_bench_serving_on_shared_prefixes_reports_cache_hits(
    observed: Observed, tmp_path: Path
) -> None:
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "bench",
            "serving",
            "--base-url",
            observed.url,
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "8",
            "--gsp-system-prompt-len",
            "512",
            "--gsp-question-len",
            "8",
            "--gsp-output-len",
            "4",
            "--max-concurrency",
            "2",
            "--flush-cache",
            "--disable-tqdm",
            "--output-file",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout
    assert "Serving Benchmark Result" in table
    rows = dict(
        (label.strip(), rest.strip())
        for label, _, rest in (line.partition(":") for line in table.splitlines())
        if rest
    )
    assert rows["Successful requests"] == "16" and rows["Failed requests"] == "0"
    assert float(rows["Cache hit rate"]) > 0.8
    for label in ("Mean TTFT (ms)", "P99 TPOT (ms)", "Median ITL (ms)", "P90 E2E Latency (ms)"):
        assert float(rows[label]) > 0
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["completed"] == 16
    assert summary["total_input_tokens"] == 16 * 520
    assert summary["total_output_tokens"] == 16 * 4
    assert summary["cache_hit_rate"] == pytest.approx(float(rows["Cache hit rate"]), abs=1e-3)

    # SGLang's native /generate (the `radixserve` backend), random prompts.
    native = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "bench",
            "serving",
            "--backend",
            "radixserve",
            "--base-url",
            observed.url,
            "--dataset-name",
            "random",
            "--num-prompts",
            "4",
            "--random-input-len",
            "32",
            "--random-output-len",
            "3",
            "--random-range-ratio",
            "1.0",
            "--request-rate",
            "20",
            "--disable-tqdm",
            "--output-file",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert native.returncode == 0, native.stderr[-2000:]
    summary = json.loads(out.read_text().splitlines()[-1])
    assert (summary["backend"], summary["completed"], summary["failed"]) == ("radixserve", 4, 0)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (4 * 32, 4 * 3)
