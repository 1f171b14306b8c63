"""An OTLP/HTTP span exporter with the JSON encoding, for when the protobuf one is absent.

OTLP/HTTP accepts JSON as well as protobuf on `/v1/traces` (the OpenTelemetry
Collector, Jaeger, Tempo and Grafana Alloy all take it), so tracing works with the
SDK alone. `opentelemetry-exporter-otlp-proto-http`, when installed, is preferred
(see `radixserve.telemetry.tracing`). The encoding follows the OTLP spec's JSON
mapping of `ExportTraceServiceRequest`: ids as lowercase hex, 64-bit integers as
strings, enums as numbers.

    exporter = OtlpJsonSpanExporter("http://collector:4318/v1/traces", headers={}, timeout_s=10)
    body = encode_spans(spans)        # what is POSTed, for tests
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

log = logging.getLogger(__name__)

# OTLP's Span.SpanKind: UNSPECIFIED 0, INTERNAL 1, SERVER 2, CLIENT 3, PRODUCER 4, CONSUMER 5.
_KINDS = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
# Failures worth another try, as the OTLP spec lists them.
_RETRYABLE = {429, 502, 503, 504}


def any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):  # before int: bool is an int
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(v)} for k, v in (attributes or {}).items()]


def encode_span(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    body: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": _KINDS.get(span.kind, 0),
        "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or 0),
        "attributes": key_values(span.attributes),
        "events": [
            {
                "timeUnixNano": str(event.timestamp),
                "name": event.name,
                "attributes": key_values(event.attributes),
            }
            for event in span.events
        ],
        "links": [
            {
                "traceId": f"{link.context.trace_id:032x}",
                "spanId": f"{link.context.span_id:016x}",
                "attributes": key_values(link.attributes),
            }
            for link in span.links
        ],
        "status": {"code": _STATUS[span.status.status_code]},
        "flags": int(ctx.trace_flags),
    }
    if span.parent is not None:
        body["parentSpanId"] = f"{span.parent.span_id:016x}"
    if span.status.description:
        body["status"]["message"] = span.status.description
    if ctx.trace_state:
        body["traceState"] = ctx.trace_state.to_header()
    return body


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """One `ExportTraceServiceRequest`: spans grouped by resource, then by scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        resource = span.resource
        _, scopes = by_resource.setdefault(id(resource), (resource, {}))
        scope = span.instrumentation_scope
        key = ("", "") if scope is None else (scope.name, scope.version or "")
        scopes.setdefault(key, []).append(encode_span(span))
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": key_values(resource.attributes)},
                "scopeSpans": [
                    {"scope": {"name": name, "version": version}, "spans": encoded}
                    for (name, version), encoded in scopes.items()
                ],
            }
            for resource, scopes in by_resource.values()
        ]
    }


class OtlpJsonSpanExporter(SpanExporter):
    """POSTs batches to an OTLP/HTTP endpoint (`.../v1/traces`) as JSON; called from the
    SDK's batch processor thread, never from an event loop.

    A failed export backs off (1 s doubling to `max_backoff_s`): batches in the pause are
    dropped without a try, so a collector that is not deployed costs no retries and one
    log line, not a line and seconds of retries every batch. `dropped` counts them."""

    def __init__(
        self,
        endpoint: str,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self._client = httpx.Client(
            headers={"Content-Type": "application/json", **(headers or {})}, timeout=timeout_s
        )
        self._closed = False
        self._warned = False
        self._first_backoff_s = backoff_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._paused_until = 0.0
        self._failing = False
        self.dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        if time.monotonic() < self._paused_until:
            self.dropped += len(spans)
            return SpanExportResult.FAILURE
        result = self._post(spans)
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                log.info("exporting spans to %s again (%d dropped)", self.endpoint, self.dropped)
            self._failing, self._backoff_s = False, self._first_backoff_s
        else:
            self.dropped += len(spans)
            self._failing = True
            self._paused_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
        return result

    def _post(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = json.dumps(encode_spans(spans)).encode()
        delay_s = 0.5
        for attempt in range(self.retries + 1):
            try:
                response = self._client.post(self.endpoint, content=body)
            except httpx.HTTPError as exc:
                reason = repr(exc)
            else:
                if response.status_code < 300:
                    return SpanExportResult.SUCCESS
                reason = f"HTTP {response.status_code}"
                if response.status_code not in _RETRYABLE:
                    break
            if attempt < self.retries:
                time.sleep(delay_s)
                delay_s *= 2
        self._warn(
            f"exporting {len(spans)} span(s) to {self.endpoint} failed: {reason}; "
            "backing off (dropping spans until it answers)"
        )
        return SpanExportResult.FAILURE

    def _warn(self, message: str) -> None:
        # Once at WARNING (a collector that is down must not flood the logs), then DEBUG.
        log.log(logging.DEBUG if self._warned else logging.WARNING, message)
        self._warned = True

    def shutdown(self) -> None:
        self._closed = True
        self._client.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
