"""Prometheus metrics (prefix `radixserve:`); OpenTelemetry tracing lives in `radixserve.bus.tracing`."""

from __future__ import annotations

from radixserve.telemetry.metrics import CONTENT_TYPE, PREFIX, GatewayMetrics

__all__ = ["CONTENT_TYPE", "PREFIX", "GatewayMetrics"]
