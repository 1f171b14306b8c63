"""Prometheus metrics (prefix `radixserve:`) and OpenTelemetry tracing (docs/operations.md).

common.py            the process's registry + what every service exports (NATS / Redis round trips)
metrics.py           the gateway's metrics      pipeline_metrics.py  tokenizer, scheduler, grammar, detokenizer
buckets.py           histogram buckets (OpenTelemetry GenAI conventions)
exposition.py        the /metrics port of services without an HTTP server
tracing.py           tracing setup (OTLP, off by default), per-request contexts on batch messages
otlp_json.py         the OTLP/HTTP JSON span exporter     genai.py  GenAI attribute names and helpers
gateway_trace.py     the gateway's root span               detok_trace.py  the detokenizer's spans
latency.py           TTFT and inter-token latency at the gateway

The worker's metrics are `radixserve.worker.metrics` (they read the engine's load).
W3C trace context in NATS headers is `radixserve.bus.tracing`'s.
"""

from __future__ import annotations

from radixserve.telemetry.metrics import CONTENT_TYPE, PREFIX, GatewayMetrics

__all__ = ["CONTENT_TYPE", "PREFIX", "GatewayMetrics"]
