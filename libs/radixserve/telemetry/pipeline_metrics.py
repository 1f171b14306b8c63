"""Metrics of the services between the gateway and the workers, one class each.

    metrics = TokenizerMetrics(ctx.metrics)          # joins the process's registry
    metrics.observe_tokenized(prompt_tokens=12, seconds=0.002)

Every class takes the process's `ServiceMetrics` (its registry and the shared NATS /
Redis round-trip histograms). Names are listed in docs/operations.md.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from radixserve.telemetry.buckets import E2E_BUCKETS, STEP_BUCKETS
from radixserve.telemetry.common import PREFIX, ServiceMetrics


class TokenizerMetrics:
    def __init__(self, common: ServiceMetrics) -> None:
        self.common = common
        r = common.registry
        self.requests = Counter(
            PREFIX + "tokenizer_requests",
            "Requests the tokenizer handled, by outcome (ok or the error code it answered)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "tokenizer_prompt_tokens",
            "Prompt tokens of the requests the tokenizer passed on",
            registry=r,
        )
        self.duration = Histogram(
            PREFIX + "tokenize_duration_seconds",
            "Chat template + tokenization + checks of one request (grammar compile excluded)",
            buckets=STEP_BUCKETS,
            registry=r,
        )

    def observe_tokenized(self, prompt_tokens: int, seconds: float) -> None:
        self.requests.labels(outcome="ok").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.duration.observe(seconds)

    def observe_refused(self, code: str) -> None:
        self.requests.labels(outcome=code).inc()


class SchedulerMetrics:
    def __init__(self, common: ServiceMetrics) -> None:
        self.common = common
        r = common.registry
        self.routed = Counter(
            PREFIX + "scheduler_routed_requests",
            "Requests routed, by worker",
            ["worker"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "scheduler_rejected_requests",
            "Requests refused or failed by the scheduler, by code (queue_full, no_worker, "
            "worker_lost)",
            ["code"],
            registry=r,
        )
        self.pending = Gauge(
            PREFIX + "scheduler_pending_requests",
            "Unfinished requests the scheduler tracks (what --max-pending-requests bounds)",
            registry=r,
        )
        self.ready_workers = Gauge(
            PREFIX + "scheduler_ready_workers", "Workers ready to take requests", registry=r
        )
        self.expected_cached = Counter(
            PREFIX + "scheduler_expected_cached_tokens",
            "Prompt tokens the routed requests' workers were expected to have cached (the "
            "KV-event mirrors' longest prefix match), by worker",
            ["worker"],
            registry=r,
        )
        self.migrated = Counter(
            PREFIX + "requests_migrated",
            "Requests re-routed, with the tokens they had generated, to another worker, by "
            "reason (worker_lost: its heartbeats stopped; worker_restarted; not_acknowledged: "
            "it did not take the request)",
            ["reason"],
            registry=r,
        )
        self.kv_snapshots = Counter(
            PREFIX + "scheduler_kv_snapshot_requests",
            "Snapshots asked of a worker whose cache mirror missed a KV event batch",
            ["worker"],
            registry=r,
        )
        # With --ha-lease: which replica serves, and how the Redis lease is doing.
        self.active = Gauge(
            PREFIX + "scheduler_active",
            "1 while this scheduler holds the lease and serves (always 1 without "
            "--ha-lease), 0 while it stands by",
            registry=r,
        )
        self.failovers = Counter(
            PREFIX + "scheduler_failovers",
            "Times this scheduler took over from another (won the lease after standing by)",
            registry=r,
        )
        self.lease_errors = Counter(
            PREFIX + "scheduler_lease_errors",
            "Lease claims or releases that failed (Redis unreachable or slow): the active "
            "one keeps serving, a standby cannot take over",
            registry=r,
        )

    def observe_routed(self, worker: str, expected_cached_tokens: int = 0) -> None:
        self.routed.labels(worker=worker).inc()
        self.expected_cached.labels(worker=worker).inc(expected_cached_tokens)

    def observe_migrated(self, reason: str) -> None:
        self.migrated.labels(reason=reason).inc()

    def observe_kv_snapshot(self, worker: str) -> None:
        self.kv_snapshots.labels(worker=worker).inc()

    def observe_rejected(self, code: str) -> None:
        self.rejected.labels(code=code).inc()

    def set_load(self, pending: int, ready_workers: int) -> None:
        # Set from the event loop: a scrape runs in another thread and must not walk the
        # scheduler's tables while they change.
        self.pending.set(pending)
        self.ready_workers.set(ready_workers)


class GrammarMetrics:
    def __init__(self, common: ServiceMetrics) -> None:
        self.common = common
        r = common.registry
        self.compile_requests = Counter(
            PREFIX + "grammar_compile_requests",
            "Grammar compile requests by kind (json_schema, regex, ebnf) and outcome (ok, error)",
            ["kind", "outcome"],
            registry=r,
        )
        self.cache_hits = Counter(
            PREFIX + "grammar_cache_hits",
            "Compile requests answered from the grammar cache, by kind",
            ["kind"],
            registry=r,
        )
        self.compile_duration = Histogram(
            PREFIX + "grammar_compile_duration_seconds",
            "Answering one compile request (a cache hit included), by kind",
            ["kind"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.compiles_stopped = Counter(
            PREFIX + "grammar_compiles_stopped",
            "Compiles stopped past --compile-limit-s (their grammar refused), by kind",
            ["kind"],
            registry=r,
        )
        self.fetch_requests = Counter(
            PREFIX + "grammar_fetch_requests",
            "Grammar fetches by workers, by outcome (ok, error)",
            ["outcome"],
            registry=r,
        )

    def observe_compile(self, kind: str, ok: bool, seconds: float, cache_hit: bool) -> None:
        self.compile_requests.labels(kind=kind, outcome="ok" if ok else "error").inc()
        self.compile_duration.labels(kind=kind).observe(seconds)
        if cache_hit:
            self.cache_hits.labels(kind=kind).inc()

    def observe_stop(self, kind: str) -> None:
        """From a compile thread (prometheus_client's counters are thread-safe)."""
        self.compiles_stopped.labels(kind=kind).inc()

    def observe_fetch(self, ok: bool) -> None:
        self.fetch_requests.labels(outcome="ok" if ok else "error").inc()


class DetokenizerMetrics:
    def __init__(self, common: ServiceMetrics) -> None:
        self.common = common
        r = common.registry
        self.step_batches = Counter(
            PREFIX + "detokenizer_step_batches",
            "Step batches decoded, by worker",
            ["worker"],
            registry=r,
        )
        self.missed_step_batches = Counter(
            PREFIX + "detokenizer_missed_step_batches",
            "Step batches that never arrived (their text is lost), by worker",
            ["worker"],
            registry=r,
        )
        self.tokens = Counter(
            PREFIX + "detokenizer_tokens",
            "Token ids turned into text",
            registry=r,
        )
        self.lost_requests = Counter(
            PREFIX + "detokenizer_lost_requests",
            "Requests failed (503 output_lost) because some of their tokens never arrived",
            registry=r,
        )
        self.output_log_dropped = Counter(
            PREFIX + "detokenizer_output_log_dropped",
            "Resumable requests' deltas not written to the output log (Redis slow or down): "
            "a resume of those requests is refused",
            registry=r,
        )
        self.live_streams = Gauge(
            PREFIX + "detokenizer_live_streams",
            "Decoding states kept (one per unfinished choice)",
            registry=r,
        )
        self.duration = Histogram(
            PREFIX + "detokenize_duration_seconds",
            "Decoding one step batch",
            buckets=STEP_BUCKETS,
            registry=r,
        )

    def observe_batch(
        self, worker: str, tokens: int, missed: int, seconds: float, live_streams: int
    ) -> None:
        self.step_batches.labels(worker=worker).inc()
        self.live_streams.set(live_streams)
        if missed:
            self.missed_step_batches.labels(worker=worker).inc(missed)
        self.tokens.inc(tokens)
        self.duration.observe(seconds)

    def observe_lost_request(self) -> None:
        self.lost_requests.inc()
