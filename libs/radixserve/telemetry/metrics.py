"""Prometheus metrics of the gateway (prefix `radixserve:`), one registry per instance.

    metrics = GatewayMetrics()
    metrics.observe_worker_stats(stats)           # WorkerStats from `{p}.stats.*`
    metrics.observe_request(status=200, prompt_tokens=12, ...)
    body = metrics.render()                       # the /metrics answer

Names and histogram buckets follow SGLang's / vLLM's metrics and the OpenTelemetry
GenAI conventions (what Kubernetes inference gateways and KEDA recipes read). Each
instance owns a `CollectorRegistry`, so two apps in one process (tests) never clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from radixserve.protocol import WorkerStats

PREFIX = "radixserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# OpenTelemetry GenAI semantic conventions: gen_ai.server.time_to_first_token,
# gen_ai.server.request.duration, gen_ai.server.time_per_output_token.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class GatewayMetrics:
    """Every metric the gateway exports, registered on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
        self.requests = Counter(
            PREFIX + "requests", "Generation requests by HTTP status", ["status"], registry=r
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
        e2e_s: float | None = None,
        ttft_s: float | None = None,
        max_choice_tokens: int = 0,
    ) -> None:
        """One finished generation request (any status). Latencies only for successes."""
        self.requests.labels(status=str(status)).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)
        if e2e_s is not None:
            self.e2e_request_latency.observe(e2e_s)
            if ttft_s is not None and max_choice_tokens > 1:
                self.time_per_output_token.observe((e2e_s - ttft_s) / (max_choice_tokens - 1))

    def observe_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
