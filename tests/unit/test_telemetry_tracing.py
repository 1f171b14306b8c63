"""Tracing: when it is on, the OTLP/HTTP JSON exporter (against a real HTTP receiver),
per-request contexts on batch messages, and the spans the gateway, worker and
detokenizer make (an SDK provider with an in-memory exporter; never the global one)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from radixserve import protocol
from radixserve.api import GenerationPlan
from radixserve.bus.tracing import inject_trace
from radixserve.telemetry import genai
from radixserve.telemetry.common import ServiceMetrics
from radixserve.telemetry.detok_trace import DetokenizeSpans
from radixserve.telemetry.gateway_trace import RequestTrace
from radixserve.telemetry.otlp_json import OtlpJsonSpanExporter, encode_spans
from radixserve.telemetry.tracing import (
    BATCH_TRACEPARENTS,
    RequestSpans,
    TracingSettings,
    build_exporter,
    decode_batch_contexts,
    encode_batch_contexts,
    parse_headers,
    setup_tracing,
    traceparent_of,
)
from radixserve.worker.metrics import WorkerMetrics, WorkerTelemetry
from tests.unit.test_telemetry import output, routed


@pytest.fixture()
def sdk() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


# -- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "flag", "exporter", "endpoint"),
    [
        ({}, None, "none", ""),
        ({"RADIXSERVE_OTLP_ENDPOINT": "http://c:4318"}, None, "otlp", "http://c:4318/v1/traces"),
        ({"RADIXSERVE_OTLP_ENDPOINT": "http://c:4318/v1/traces"}, None, "otlp",
         "http://c:4318/v1/traces"),
        ({"RADIXSERVE_OTLP_ENDPOINT": "http://a:1"}, "http://b:2/", "otlp", "http://b:2/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:4318"}, None, "otlp", "http://o:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:4318",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom"}, None, "otlp",
         "http://t:9/custom"),
        ({"RADIXSERVE_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, None,
         "none", ""),
        ({"RADIXSERVE_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None,
         "none", ""),
        ({"OTEL_TRACES_EXPORTER": "console"}, None, "console", ""),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://g:4317"},
         None, "otlp", "http://g:4317"),
    ],
)  # fmt: skip
def test_tracing_is_off_unless_an_endpoint_or_exporter_is_configured(
    env: dict[str, str], flag: str | None, exporter: str, endpoint: str
) -> None:
    settings = TracingSettings.from_env(env, endpoint=flag)
    assert (settings.exporter, settings.endpoint) == (exporter, endpoint)
    assert settings.enabled == (exporter != "none")


def test_standard_otlp_headers_timeout_and_protocol_are_honoured() -> None:
    settings = TracingSettings.from_env(
        {
            "RADIXSERVE_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc, x-tenant = t1,junk",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
        }
    )
    assert dict(settings.headers) == {"authorization": "Bearer abc", "x-tenant": "t1"}
    assert settings.timeout_s == 2.5 and settings.protocol == "http/json"
    assert parse_headers("") == {}
    exporter = build_exporter(settings)
    assert isinstance(exporter, OtlpJsonSpanExporter)
    assert exporter.endpoint == "http://c:4318/v1/traces"
    exporter.shutdown()
    assert isinstance(build_exporter(TracingSettings(exporter="console")), ConsoleSpanExporter)


def test_grpc_without_its_exporter_package_turns_tracing_off() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        settings = TracingSettings(exporter="otlp", endpoint="http://g:4317", protocol="grpc")
        assert build_exporter(settings) is None
    else:
        pytest.skip("the gRPC exporter is installed")


def test_setup_does_nothing_when_tracing_is_off() -> None:
    before = trace.get_tracer_provider()
    handle = setup_tracing(TracingSettings(), "worker", "worker-0")
    assert handle.provider is None and trace.get_tracer_provider() is before
    handle.shutdown()


# -- the OTLP/HTTP JSON exporter -------------------------------------------------------------


class Receiver:
    def __init__(self, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                outer.bodies.append(json.loads(raw))
                outer.headers.append(dict(self.headers))
                self.send_response(outer.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def some_spans(tracer: Tracer, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent:
        parent.set_attributes({"n": 3, "x": 0.5, "ok": True, "s": "v", "reasons": ["stop"]})
        with tracer.start_as_current_span("child", kind=SpanKind.CONSUMER) as child:
            child.add_event("gen_ai.first_token", {"k": 1})
            child.set_status(Status(StatusCode.ERROR, "bad"))
    return list(exporter.get_finished_spans())


def test_spans_encode_as_otlp_json(sdk: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer, memory = sdk
    spans = some_spans(tracer, memory)
    body = encode_spans(spans)
    (resource_spans,) = body["resourceSpans"]
    (scope_spans,) = resource_spans["scopeSpans"]
    assert scope_spans["scope"]["name"] == "test"
    encoded = {s["name"]: s for s in scope_spans["spans"]}
    parent, child = encoded["parent"], encoded["child"]
    assert len(parent["traceId"]) == 32 and len(parent["spanId"]) == 16
    assert child["traceId"] == parent["traceId"] and child["parentSpanId"] == parent["spanId"]
    assert "parentSpanId" not in parent
    assert (parent["kind"], child["kind"]) == (2, 5)  # SERVER, CONSUMER
    attrs = {a["key"]: a["value"] for a in parent["attributes"]}
    assert attrs == {
        "n": {"intValue": "3"},
        "x": {"doubleValue": 0.5},
        "ok": {"boolValue": True},
        "s": {"stringValue": "v"},
        "reasons": {"arrayValue": {"values": [{"stringValue": "stop"}]}},
    }
    assert child["status"] == {"code": 2, "message": "bad"}
    assert child["events"][0]["name"] == "gen_ai.first_token"
    assert int(child["endTimeUnixNano"]) >= int(child["startTimeUnixNano"]) > 0
    json.dumps(body)  # plain JSON


def test_exporter_posts_to_a_receiver_and_reports_failures(
    sdk: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, memory = sdk
    spans = some_spans(tracer, memory)
    receiver, refusing = Receiver(), Receiver(status=400)
    try:
        exporter = OtlpJsonSpanExporter(receiver.url, headers={"x-tenant": "t1"}, timeout_s=5)
        assert exporter.export(spans).name == "SUCCESS"
        assert receiver.bodies == [json.loads(json.dumps(encode_spans(spans)))]
        assert receiver.headers[0]["x-tenant"] == "t1"
        assert receiver.headers[0]["Content-Type"] == "application/json"
        exporter.shutdown()
        assert exporter.export(spans).name == "FAILURE"  # after shutdown

        refused = OtlpJsonSpanExporter(refusing.url, timeout_s=5, retries=2)
        assert refused.export(spans).name == "FAILURE"
        assert len(refusing.bodies) == 1  # a 400 is not retried
        refused.shutdown()
    finally:
        receiver.close()
        refusing.close()
    started = time.monotonic()
    dead = OtlpJsonSpanExporter(receiver.url, timeout_s=1, retries=0)
    assert dead.export(spans).name == "FAILURE"
    assert time.monotonic() - started < 5
    dead.shutdown()


def test_a_missing_collector_is_logged_once_and_backed_off(
    sdk: tuple[Tracer, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    tracer, memory = sdk
    spans = some_spans(tracer, memory)
    down = Receiver(status=503)
    exporter = OtlpJsonSpanExporter(down.url, timeout_s=5, retries=1, backoff_s=0.5)
    try:
        with caplog.at_level(logging.DEBUG, logger="radixserve.telemetry.otlp_json"):
            for _ in range(5):  # one try (and its retry), then batches dropped untried
                assert exporter.export(spans).name == "FAILURE"
            assert len(down.bodies) == 2
            assert exporter.dropped == 5 * len(spans)
            time.sleep(0.6)  # the pause is over: the next batch is tried again
            down.status = 200
            assert exporter.export(spans).name == "SUCCESS"
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "backing off" in warnings[0].getMessage()
        assert any("again (10 dropped)" in r.getMessage() for r in caplog.records)
    finally:
        exporter.shutdown()
        down.close()


# -- contexts on batch messages ----------------------------------------------------------------


def test_batch_contexts_round_trip_and_skip_what_is_malformed(
    sdk: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = sdk
    with tracer.start_as_current_span("a") as a, tracer.start_as_current_span("b") as b:
        headers = encode_batch_contexts(
            {0: a.get_span_context(), 3: b.get_span_context(), 5: trace.INVALID_SPAN_CONTEXT}
        )
    value = headers[BATCH_TRACEPARENTS]
    assert value.count("=") == 2 and traceparent_of(b.get_span_context()) in value
    contexts = decode_batch_contexts({BATCH_TRACEPARENTS: value + ";x=junk;7=00-zz;;"})
    assert sorted(contexts) == [0, 3]
    assert trace.get_current_span(contexts[3]).get_span_context().span_id == (
        b.get_span_context().span_id
    )
    assert encode_batch_contexts({}) == {} and decode_batch_contexts(None) == {}


def test_open_spans_are_bounded(sdk: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer, memory = sdk
    spans = RequestSpans(max_open=2)
    for rid in ("r1", "r2", "r3"):
        spans.add(rid, tracer.start_span(rid))
    assert "r1" not in spans and len(spans) == 2
    (evicted,) = memory.get_finished_spans()
    assert evicted.name == "r1" and evicted.attributes["radixserve.span.evicted"] is True
    popped = spans.pop("r2")
    assert popped is not None and spans.get("r2") is None
    spans.end_all()
    assert len(spans) == 0 and len(memory.get_finished_spans()) == 2


# -- the services' spans ---------------------------------------------------------------------


def test_worker_span_follows_a_request_and_parents_the_detokenizer(
    sdk: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, memory = sdk
    telemetry = WorkerTelemetry(WorkerMetrics(ServiceMetrics("worker", "w-0"), "w-0"), tracer)
    detok = DetokenizeSpans(tracer=tracer)
    with tracer.start_as_current_span("radixserve.schedule") as schedule:
        telemetry.received(routed("a"))
    first = [output("a", [7], 1, first=True)]
    telemetry.observe_step(time.perf_counter(), 0.01, 1, first)
    headers = telemetry.batch_headers(first)
    detok.observe(headers, protocol.StepOutputBatch(worker_id="w-0", step=1, outputs=first))
    last = [output("a", [8, 9], 3, finish="length")]
    telemetry.observe_step(time.perf_counter(), 0.01, 1, last)
    assert telemetry.batch_headers(last) == {}  # no choice opens here; "a" is forgotten
    detok.observe({}, protocol.StepOutputBatch(worker_id="w-0", step=2, outputs=last))

    spans = by_name(memory)
    worker, detokenize = spans[genai.SPAN_WORKER], spans[genai.SPAN_DETOKENIZE]
    assert worker.parent is not None
    assert worker.parent.span_id == schedule.get_span_context().span_id
    assert detokenize.parent is not None
    assert detokenize.parent.span_id == worker.context.span_id
    assert [e.name for e in worker.events] == [
        genai.EVENT_QUEUED,
        genai.EVENT_SCHEDULED,
        genai.EVENT_FIRST_TOKEN,
    ]
    assert worker.attributes[genai.USAGE_INPUT_TOKENS] == 10
    assert worker.attributes[genai.USAGE_OUTPUT_TOKENS] == 3
    assert worker.attributes[genai.USAGE_CACHED_INPUT_TOKENS] == 4
    assert worker.attributes[genai.RESPONSE_FINISH_REASONS] == ("length",)
    assert worker.attributes[genai.WORKER_ID] == "w-0"
    assert detokenize.attributes[genai.USAGE_OUTPUT_TOKENS] == 3
    assert detokenize.kind is SpanKind.CONSUMER


def test_worker_spans_of_refused_and_forgotten_requests_end(
    sdk: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, memory = sdk
    metrics = WorkerMetrics(ServiceMetrics("worker", "w-0"), "w-0")
    telemetry = WorkerTelemetry(metrics, tracer, max_tracked=2)
    telemetry.received(routed("bad"))
    telemetry.rejected("bad", "invalid_request_error", "temperature must be >= 0")
    telemetry.received(routed("waiting"))
    with telemetry.active("waiting"):
        assert trace.get_current_span().get_span_context().is_valid
        assert "traceparent" in inject_trace()
    telemetry.forget("waiting")
    for rid in ("x", "y", "z"):  # past max_tracked the oldest is ended
        telemetry.received(routed(rid))
    ended = [s.name for s in memory.get_finished_spans()]
    assert ended.count(genai.SPAN_WORKER) == 3
    bad = memory.get_finished_spans()[0]
    assert bad.status.status_code is StatusCode.ERROR
    assert bad.attributes[genai.ERROR_CODE] == "invalid_request_error"
    assert (
        metrics.common.registry.get_sample_value(
            "radixserve:worker_rejected_requests_total",
            {"worker": "w-0", "code": "invalid_request_error"},
        )
        == 1
    )


def plan(text: str) -> GenerationPlan:
    submit = protocol.SubmitRequest(
        rid="chatcmpl-1",
        gateway_id="g",
        messages=[protocol.ChatMessage(role="user", content=text)],
        sampling=protocol.SamplingParams(max_new_tokens=7, temperature=0.5),
    )
    return GenerationPlan(
        endpoint="chat", response_id="chatcmpl-1", model="m", submits=(submit,), n=1, stream=False
    )


def test_gateway_span_has_the_genai_attributes_and_no_text_by_default(
    sdk: tuple[Tracer, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch
) -> None:
    tracer, memory = sdk
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    request = RequestTrace(plan("my secret prompt"), tracer=tracer)
    with request.active():
        carried = inject_trace()
    assert carried["traceparent"] == traceparent_of(request.span.get_span_context())
    request.first_token()
    request.finish(
        status=200,
        prompt_tokens=12,
        completion_tokens=5,
        cached_tokens=8,
        finish_reasons=["stop"],
        outputs=["my secret answer"],
    )
    (span,) = memory.get_finished_spans()
    assert span.name == "chat m" and span.kind is SpanKind.SERVER
    assert dict(span.attributes) == {
        genai.OPERATION_NAME: "chat",
        genai.PROVIDER_NAME: "radixserve",
        genai.REQUEST_MODEL: "m",
        genai.REQUEST_MAX_TOKENS: 7,
        genai.REQUEST_TEMPERATURE: 0.5,
        genai.REQUEST_TOP_P: 1.0,
        genai.RESPONSE_ID: "chatcmpl-1",
        genai.REQUEST_ID: "chatcmpl-1",
        genai.USAGE_INPUT_TOKENS: 12,
        genai.USAGE_OUTPUT_TOKENS: 5,
        genai.USAGE_CACHED_INPUT_TOKENS: 8,
        genai.RESPONSE_FINISH_REASONS: ("stop",),
        genai.RESPONSE_MODEL: "m",
        genai.HTTP_STATUS: 200,
    }
    assert [e.name for e in span.events] == [genai.EVENT_FIRST_TOKEN]
    assert "secret" not in json.dumps(encode_spans([span]))

    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    failed = RequestTrace(plan("my secret prompt"), tracer=tracer)
    failed.finish(
        status=400,
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        finish_reasons=[],
        error_type="invalid_request_error",
        error_message="context_length_exceeded",
        outputs=["my secret answer"],
    )
    captured = memory.get_finished_spans()[-1]
    assert captured.status.status_code is StatusCode.ERROR
    assert "my secret prompt" in str(captured.attributes[genai.INPUT_MESSAGES])
    assert "my secret answer" in str(captured.attributes[genai.OUTPUT_MESSAGES])
