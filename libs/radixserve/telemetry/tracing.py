"""OpenTelemetry tracing for one service process: setup, per-request spans, batch contexts.

    settings = TracingSettings.from_env(os.environ, endpoint=flag)   # off unless configured
    handle = setup_tracing(settings, service="worker", instance_id="worker-0")
    tracer = get_tracer("worker")          # a no-op tracer while tracing is off
    ...
    handle.shutdown()                      # flush what is buffered (on exit)

Off by default. On when an endpoint is given (`--otlp-endpoint`,
`RADIXSERVE_OTLP_ENDPOINT`, or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT`) or when `OTEL_TRACES_EXPORTER=console`; off again with
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The protocol is
`OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`: `http/protobuf` (the default; uses
opentelemetry-exporter-otlp-proto-http when installed, else the same endpoint with
the JSON encoding), `http/json`, or `grpc` (needs opentelemetry-exporter-otlp-proto-grpc).
Headers, timeout, sampler (`OTEL_TRACES_SAMPLER`), batch settings (`OTEL_BSP_*`),
`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` are honoured as the SDK defines them.

Trace context crosses NATS in headers (`radixserve.bus.tracing`). A worker's step
batch mixes many requests, so its one `traceparent` cannot parent them all: the
worker adds `radixserve-traceparents` (`<output index>=<traceparent>;...`) for the
outputs that open a choice, and the detokenizer parents each request's span on it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanContext, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

ENV_OTLP_ENDPOINT = "RADIXSERVE_OTLP_ENDPOINT"
# The OpenTelemetry GenAI instrumentations' switch for recording prompt/completion text.
ENV_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
TRACER_PREFIX = "radixserve."
BATCH_TRACEPARENTS = "radixserve-traceparents"
_TRACE_PATH = "/v1/traces"


def get_tracer(service: str) -> Tracer:
    """The service's tracer (a proxy: a no-op until `setup_tracing` installs a provider)."""
    return trace.get_tracer(TRACER_PREFIX + service)


def capture_content_enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_CAPTURE_CONTENT, "").strip().lower() == "true"


def _first(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def parse_headers(raw: str) -> dict[str, str]:
    """`OTEL_EXPORTER_OTLP_HEADERS`: `key1=value1,key2=value2`, values URL-encoded."""
    headers: dict[str, str] = {}
    for item in raw.split(","):
        if "=" not in item:
            continue
        key, _, value = item.partition("=")
        if key.strip():
            headers[key.strip()] = unquote(value.strip())
    return headers


@dataclass(frozen=True)
class TracingSettings:
    """Where spans go; `exporter == "none"` means tracing is off."""

    exporter: str = "none"  # "otlp" | "console" | "none"
    endpoint: str = ""  # full URL of the traces endpoint (…/v1/traces for OTLP/HTTP)
    protocol: str = "http/protobuf"
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, endpoint: str | None = None
    ) -> TracingSettings:
        """`endpoint` (the `--otlp-endpoint` flag) wins over `RADIXSERVE_OTLP_ENDPOINT`,
        which wins over the standard OTEL variables. A base URL gets `/v1/traces`."""
        env = os.environ if environ is None else environ
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        chosen = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if chosen == "none":
            return cls()
        if chosen == "console":
            return cls(exporter="console")
        if chosen not in ("", "otlp"):
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", chosen)
        protocol = (
            _first(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        url = (endpoint or "").strip() or env.get(ENV_OTLP_ENDPOINT, "").strip()
        signal_url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if url:
            url = _traces_url(url, protocol)
        elif signal_url:
            url = signal_url  # the signal-specific one is used as given
        else:
            base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            url = _traces_url(base, protocol) if base else ""
        if not url:
            return cls()
        timeout_ms = _first(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
        headers = parse_headers(
            _first(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
        )
        return cls(
            exporter="otlp",
            endpoint=url,
            protocol=protocol,
            headers=tuple(headers.items()),
            timeout_s=float(timeout_ms) / 1000 if timeout_ms else 10.0,
        )


def _traces_url(base: str, protocol: str) -> str:
    if protocol == "grpc" or base.rstrip("/").endswith(_TRACE_PATH):
        return base
    return base.rstrip("/") + _TRACE_PATH


@dataclass
class TracingHandle:
    """The installed provider; `shutdown` flushes the spans still buffered."""

    provider: TracerProvider | None = None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def build_exporter(settings: TracingSettings) -> SpanExporter | None:
    """The exporter `settings` asks for, or None (logged) when it cannot be had."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from radixserve.telemetry.otlp_json import OtlpJsonSpanExporter

    if settings.exporter == "console":
        return ConsoleSpanExporter()
    headers = dict(settings.headers)
    if settings.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            log.error(
                "OTLP/gRPC needs opentelemetry-exporter-otlp-proto-grpc; tracing is off "
                "(or use OTEL_EXPORTER_OTLP_PROTOCOL=http/json with the OTLP/HTTP port)"
            )
            return None
        exporter: SpanExporter = GrpcExporter(
            endpoint=settings.endpoint, headers=headers, timeout=int(settings.timeout_s)
        )
        return exporter
    if settings.protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as HttpExporter,
            )
        except ImportError:
            log.info("opentelemetry-exporter-otlp-proto-http is not installed: OTLP/HTTP JSON")
        else:
            exporter = HttpExporter(
                endpoint=settings.endpoint, headers=headers, timeout=int(settings.timeout_s)
            )
            return exporter
    elif settings.protocol != "http/json":
        log.warning("unknown OTLP protocol %r; using http/json", settings.protocol)
    return OtlpJsonSpanExporter(settings.endpoint, headers=headers, timeout_s=settings.timeout_s)


def setup_tracing(settings: TracingSettings, service: str, instance_id: str) -> TracingHandle:
    """Install a TracerProvider with a batch exporter, once per process (a no-op when off)."""
    if not settings.enabled:
        return TracingHandle()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = build_exporter(settings)
    if exporter is None:
        return TracingHandle()
    attributes: dict[str, Any] = {
        "service.namespace": "radixserve",
        "service.instance.id": instance_id,
        "radixserve.service": service,
    }
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        attributes["service.name"] = f"radixserve-{service}"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing to %s (%s)", settings.endpoint or settings.exporter, settings.protocol)
    return TracingHandle(provider)


# -- several requests' contexts on one message ------------------------------------------


def traceparent_of(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def encode_batch_contexts(contexts: Mapping[int, SpanContext]) -> dict[str, str]:
    """The header that gives some items of a batch message their own parent span."""
    valid = {i: c for i, c in contexts.items() if c.is_valid}
    if not valid:
        return {}
    return {BATCH_TRACEPARENTS: ";".join(f"{i}={traceparent_of(c)}" for i, c in valid.items())}


def decode_batch_contexts(headers: Mapping[str, str] | None) -> dict[int, Context]:
    """Item index -> the context to parent that item's span on (malformed parts skipped)."""
    raw = (headers or {}).get(BATCH_TRACEPARENTS, "")
    propagator = TraceContextTextMapPropagator()
    contexts: dict[int, Context] = {}
    for part in raw.split(";"):
        index, _, traceparent = part.partition("=")
        if not index.strip().isdigit():
            continue
        ctx = propagator.extract({"traceparent": traceparent.strip()})
        if trace.get_current_span(ctx).get_span_context().is_valid:
            contexts[int(index)] = ctx
    return contexts


class RequestSpans:
    """Open spans by request id, bounded: past `max_open` the oldest is ended (so a
    request whose end was never seen cannot leak). Thread-safe: the worker opens
    spans on its event loop and ends them in the engine thread."""

    def __init__(self, max_open: int = 65536) -> None:
        self.max_open = max_open
        self._spans: OrderedDict[str, Span] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._spans)

    def __contains__(self, rid: object) -> bool:
        return rid in self._spans

    def add(self, rid: str, span: Span) -> None:
        evicted: list[Span] = []
        with self._lock:
            old = self._spans.pop(rid, None)
            if old is not None:
                evicted.append(old)
            self._spans[rid] = span
            while len(self._spans) > self.max_open:
                evicted.append(self._spans.popitem(last=False)[1])
        for span in evicted:
            span.set_attribute("radixserve.span.evicted", True)
            span.end()

    def get(self, rid: str) -> Span | None:
        with self._lock:
            return self._spans.get(rid)

    def pop(self, rid: str) -> Span | None:
        with self._lock:
            return self._spans.pop(rid, None)

    def end_all(self) -> None:
        with self._lock:
            spans = list(self._spans.values())
            self._spans.clear()
        for span in spans:
            span.end()
