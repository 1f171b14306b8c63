"""W3C trace context in NATS headers, through OpenTelemetry's global propagator.

    headers = inject_trace({"rid": "r1"})   # adds `traceparent` from the current span
    ctx = extract_trace(msg.headers)        # the sender's context, to parent new spans

Without an active span nothing is added, so untraced traffic carries no header.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate
from opentelemetry.context import Context

TRACEPARENT = "traceparent"


def inject_trace(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``headers`` plus the current trace context."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_trace(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by ``headers`` (empty context when there is none)."""
    return propagate.extract(dict(headers or {}))
