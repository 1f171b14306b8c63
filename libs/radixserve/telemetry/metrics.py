"""Prometheus metrics of the gateway (prefix `radixserve:`), one registry per instance.

    metrics = GatewayMetrics(common=ctx.metrics)  # joins the process's registry
    metrics.observe_worker_stats(stats)           # WorkerStats from `{p}.stats.*`
    metrics.observe_request(status=200, prompt_tokens=12, ...)
    body = metrics.render()                       # the /metrics answer

Names and histogram buckets follow SGLang's / vLLM's metrics and the OpenTelemetry
GenAI conventions (what Kubernetes inference gateways and KEDA recipes read). Series
here describe what clients got and carry no `worker` label, except the load gauges,
which mirror the workers' own (`WorkerStats`). docs/operations.md lists every name.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixserve.protocol import WorkerStats
from radixserve.telemetry.buckets import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from radixserve.telemetry.common import CONTENT_TYPE, PREFIX, ServiceMetrics

__all__ = [
    "CONTENT_TYPE",
    "E2E_BUCKETS",
    "PREFIX",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "GatewayMetrics",
]


class GatewayMetrics:
    """Every metric the gateway exports, registered on its process's registry."""

    def __init__(
        self, registry: CollectorRegistry | None = None, common: ServiceMetrics | None = None
    ) -> None:
        self.common = common or ServiceMetrics("gateway", "gateway", registry)
        self.registry = self.common.registry
        r = self.registry
        # Worker load, as the workers report it on `{p}.stats.*`.
        self.num_running_reqs = Gauge(
            PREFIX + "num_running_reqs", "Requests running on a worker", ["worker"], registry=r
        )
        self.num_queue_reqs = Gauge(
            PREFIX + "num_queue_reqs", "Requests waiting on a worker", ["worker"], registry=r
        )
        self.token_usage = Gauge(
            PREFIX + "token_usage", "In-use share of a worker's KV pool", ["worker"], registry=r
        )
        self.cache_hit_rate = Gauge(
            PREFIX + "cache_hit_rate",
            "Cached prompt tokens / prompt tokens on a worker (recent window)",
            ["worker"],
            registry=r,
        )
        # What this gateway served.
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens",
            "Prompt tokens of finished requests that the radix cache served",
            registry=r,
        )
        self.requests = Counter(
            PREFIX + "requests", "Generation requests by HTTP status", ["status"], registry=r
        )
        self.finished_requests = Counter(
            PREFIX + "finished_requests",
            "Finished choices by finish reason (stop, length, abort)",
            ["finish_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            PREFIX + "request_errors",
            "Failed generation requests by OpenAI error type and code",
            ["error_type", "code"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to the first generated text",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to the last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Decode time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between a choice's token deliveries, per token",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.store_write_failures = Counter(
            PREFIX + "store_write_failures",
            "Request-record writes to Redis that were dropped (queue full) or failed",
            registry=r,
        )

    # -- worker load -----------------------------------------------------------------------
    def observe_worker_stats(self, stats: WorkerStats) -> None:
        worker = stats.worker_id
        self.num_running_reqs.labels(worker=worker).set(stats.num_running_reqs)
        self.num_queue_reqs.labels(worker=worker).set(stats.num_queue_reqs)
        self.token_usage.labels(worker=worker).set(stats.token_usage)
        self.cache_hit_rate.labels(worker=worker).set(stats.cache_hit_rate)

    def forget_worker(self, worker: str) -> None:
        """Drop a gone worker's series, so a dead worker's last load does not linger."""
        for gauge in (
            self.num_running_reqs,
            self.num_queue_reqs,
            self.token_usage,
            self.cache_hit_rate,
        ):
            try:
                gauge.remove(worker)
            except KeyError:
                pass

    # -- requests --------------------------------------------------------------------------
    def observe_request(
        self,
        *,
        status: int,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        e2e_s: float | None = None,
        ttft_s: float | None = None,
        max_choice_tokens: int = 0,
        finish_reasons: Iterable[str] = (),
        error_type: str | None = None,
        error_code: str | None = None,
    ) -> None:
        """One finished generation request (any status). Latencies only for successes."""
        self.requests.labels(status=str(status)).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)
        for reason in finish_reasons:
            self.finished_requests.labels(finish_reason=reason).inc()
        if error_type is not None:
            self.request_errors.labels(error_type=error_type, code=error_code or error_type).inc()
        if e2e_s is not None:
            self.e2e_request_latency.observe(e2e_s)
            if ttft_s is not None and max_choice_tokens > 1:
                self.time_per_output_token.observe((e2e_s - ttft_s) / (max_choice_tokens - 1))

    def observe_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def observe_inter_token(self, per_token_s: float, count: int) -> None:
        """`count` tokens arrived `per_token_s * count` after the choice's previous ones."""
        for _ in range(count):
            self.inter_token_latency.observe(per_token_s)

    def render(self) -> bytes:
        return self.common.render()
