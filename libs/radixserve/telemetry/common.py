"""What every service process exports, on the registry its own metrics join.

    common = ServiceMetrics("tokenizer", "tokenizer-0")     # a fresh registry per process
    with common.time_nats("grammar.compile"):               # outcome ok / timeout / ...
        reply = await bus.request(...)
    body = common.render()                                  # the /metrics answer

One `CollectorRegistry` per process (never prometheus_client's global default one),
so two services in one test process never clash and nothing leaks between tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from radixserve.telemetry.buckets import ROUND_TRIP_BUCKETS

PREFIX = "radixserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(registry: CollectorRegistry) -> bytes:
    """The /metrics answer of every port: the text format, whatever the scraper accepts."""
    return generate_latest(registry)


def outcome_of(exc: BaseException | None) -> str:
    """A small, fixed label value for how a round trip ended."""
    if exc is None:
        return "ok"
    name = type(exc).__name__
    if name in ("BusTimeout", "TimeoutError"):
        return "timeout"
    if name == "BusNoResponders":
        return "no_responders"
    if name == "CancelledError":
        return "cancelled"
    return "error"


class ServiceMetrics:
    """The process's registry plus the metrics every service shares."""

    def __init__(
        self, service: str, instance: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux /proc)
        ProcessCollector(registry=r)
        self.service_info = Gauge(
            PREFIX + "service_info",
            "1 for this process; labels say which service and instance it is",
            ["service", "instance"],
            registry=r,
        )
        self.service_info.labels(service=service, instance=instance).set(1)
        self.nats_request_duration = Histogram(
            PREFIX + "nats_request_duration_seconds",
            "NATS request/reply round trips this process made, by operation and outcome",
            ["operation", "outcome"],
            buckets=ROUND_TRIP_BUCKETS,
            registry=r,
        )
        self.redis_request_duration = Histogram(
            PREFIX + "redis_request_duration_seconds",
            "Redis round trips this process made, by operation and outcome",
            ["operation", "outcome"],
            buckets=ROUND_TRIP_BUCKETS,
            registry=r,
        )

    @contextmanager
    def time_nats(self, operation: str) -> Iterator[None]:
        with _timed(self.nats_request_duration, operation):
            yield

    @contextmanager
    def time_redis(self, operation: str) -> Iterator[None]:
        with _timed(self.redis_request_duration, operation):
            yield

    def render(self) -> bytes:
        return render(self.registry)


@contextmanager
def _timed(histogram: Histogram, operation: str) -> Iterator[None]:
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        histogram.labels(operation=operation, outcome=outcome_of(error)).observe(
            time.perf_counter() - started
        )
