"""The worker's metrics and request spans: what the engine thread measures, step by step.

    telemetry = WorkerTelemetry(WorkerMetrics(ctx.metrics, worker_id), get_tracer("worker"))
    telemetry.received(routed)                  # event loop, in the NATS handler's context
    telemetry.observe_step(started, seconds, batch_size, outputs)   # engine thread
    telemetry.resumed()                         # engine thread: a re-routed request taken
    headers = telemetry.batch_headers(outputs)  # event loop, before publishing the batch
    telemetry.observe_load(load)                # every stats tick: gauges + hit rate

Every series carries the `worker` label. Counters are exact sums of the counters in
the published `StepOutput`s: generated tokens as they are produced, and per finished
choice its finish reason and cache query/hit tokens; prompt tokens once per request.
A request's span starts when the worker receives it (parent: the scheduler's span),
gets a `radixserve.queued` event then and `radixserve.scheduled` + `gen_ai.first_token`
at the step that produced its first token, and ends when its last choice finishes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import (
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    use_span,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixserve import protocol
from radixserve.telemetry import genai
from radixserve.telemetry.buckets import BATCH_SIZE_BUCKETS, E2E_BUCKETS, STEP_BUCKETS
from radixserve.telemetry.common import PREFIX, ServiceMetrics
from radixserve.telemetry.tracing import encode_batch_contexts

if TYPE_CHECKING:
    from radixserve.engine.engine import EngineLoad
    from radixserve.engine.kvcache.hiradix_cache import HostCacheStats


class WorkerMetrics:
    def __init__(self, common: ServiceMetrics, worker_id: str) -> None:
        self.common = common
        self.worker_id = worker_id
        r = common.registry
        w = ["worker"]
        self.num_running_reqs = _gauge(r, "num_running_reqs", "Requests holding KV (running)", w)
        self.num_queue_reqs = _gauge(r, "num_queue_reqs", "Requests waiting for admission", w)
        self.token_usage = _gauge(r, "token_usage", "In-use share of the KV pool (0..1)", w)
        self.cache_hit_rate = _gauge(
            r, "cache_hit_rate", "Cached / queried prompt tokens since the last stats tick", w
        )
        self.cache_config_info = _gauge(
            r,
            "cache_config_info",
            "1; the labels give the KV cache's page size and number of pages",
            ["worker", "page_size", "num_pages"],
        )
        self.start_duration = _gauge(
            r,
            "worker_start_seconds",
            "Seconds the worker took to get ready: model load and kernel builds",
            w,
        )
        self.prompt_tokens = _counter(r, "prompt_tokens", "Prompt tokens of finished requests", w)
        self.generation_tokens = _counter(r, "generation_tokens", "Tokens generated", w)
        self.cache_query_tokens = _counter(
            r, "cache_query_tokens", "Prompt tokens looked up in the radix cache (per choice)", w
        )
        self.cache_hit_tokens = _counter(
            r, "cache_hit_tokens", "Prompt tokens the radix cache served (per choice)", w
        )
        tier = ["worker", "tier", "direction"]
        self.cache_tier_tokens = _counter(
            r,
            "cache_tier_tokens",
            "Tokens of KV moved between the device and a lower cache tier (HiCache): "
            "direction load (a hit there, brought back for a request), write or drop",
            tier,
        )
        self.cache_tier_bytes = _counter(
            r, "cache_tier_bytes", "Bytes of KV moved to (write) or from (load) a cache tier", tier
        )
        self.cache_tier_seconds = _counter(
            r,
            "cache_tier_seconds",
            "Host seconds spent moving KV to (write) or from (load) a cache tier",
            tier,
        )
        self.cache_tier_usage = _gauge(
            r, "cache_tier_usage", "In-use share of a lower cache tier (0..1)", ["worker", "tier"]
        )
        self.finished_requests = _counter(
            r,
            "finished_requests",
            "Finished choices by finish reason (stop, length, abort)",
            ["worker", "finish_reason"],
        )
        self.rejected_requests = _counter(
            r,
            "worker_rejected_requests",
            "Requests the worker refused, by code",
            ["worker", "code"],
        )
        self.resumed_requests = _counter(
            r,
            "worker_resumed_requests",
            "Requests taken over after another worker died, continuing from its tokens",
            w,
        )
        self.forward_passes = _counter(
            r,
            "forward_passes",
            "Forward passes by how they ran: decode_graph (a decode CUDA graph), "
            "prefill_pieces (captured pieces around eager attention) or eager",
            ["worker", "kind"],
        )
        self.step_duration = _histogram(
            r, "step_duration_seconds", "One engine step (schedule, forward, sample)", STEP_BUCKETS
        )
        self.step_device_wait = _counter(
            r,
            "step_device_wait_seconds",
            "Seconds engine steps spent blocked on the device for sampled tokens; "
            "the rest of step_duration_seconds is the host's own work",
            w,
        )
        self.batch_size = _histogram(
            r, "batch_size", "Requests that got a token in one engine step", BATCH_SIZE_BUCKETS
        )
        self.queue_time = _histogram(
            r,
            "request_queue_time_seconds",
            "Received by the worker to the start of the step that produced its first token",
            E2E_BUCKETS,
        )

    def label(self) -> dict[str, str]:
        return {"worker": self.worker_id}

    def set_cache_config(self, page_size: int, num_pages: int) -> None:
        self.cache_config_info.labels(
            worker=self.worker_id, page_size=str(page_size), num_pages=str(num_pages)
        ).set(1)


def _gauge(r: CollectorRegistry, name: str, doc: str, labels: list[str]) -> Gauge:
    return Gauge(PREFIX + name, doc, labels, registry=r)


def _counter(r: CollectorRegistry, name: str, doc: str, labels: list[str]) -> Counter:
    return Counter(PREFIX + name, doc, labels, registry=r)


def _histogram(r: CollectorRegistry, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
    return Histogram(PREFIX + name, doc, ["worker"], buckets=buckets, registry=r)


class HitRateWindow:
    """Cache hit rate over the prompt tokens queried since the previous call; the last
    value is kept through an interval with no new prompts."""

    def __init__(self) -> None:
        self._hit = 0.0
        self._query = 0.0
        self.rate = 0.0

    def update(self, hit_total: float, query_total: float) -> float:
        queried = query_total - self._query
        if queried > 0:
            self.rate = (hit_total - self._hit) / queried
        self._hit, self._query = hit_total, query_total
        return self.rate


@dataclass
class _Track:
    """A request's span and timing, between `received` and its last choice's finish."""

    span: Span
    received_at: float  # perf_counter
    choices_left: int
    started: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


class WorkerTelemetry:
    def __init__(self, metrics: WorkerMetrics, tracer: Tracer, max_tracked: int = 65536) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.max_tracked = max_tracked
        w = metrics.label()
        self._generation = metrics.generation_tokens.labels(**w)
        self._prompt = metrics.prompt_tokens.labels(**w)
        self._query = metrics.cache_query_tokens.labels(**w)
        self._hit = metrics.cache_hit_tokens.labels(**w)
        self._step_duration = metrics.step_duration.labels(**w)
        self._batch_size = metrics.batch_size.labels(**w)
        self._queue_time = metrics.queue_time.labels(**w)
        self._hit_rate = HitRateWindow()
        self._hit_total = 0  # the cache counters' values, for the hit-rate window
        self._query_total = 0
        self._passes_seen: dict[str, int] = {}  # the engine's forward-pass totals, last tick
        self._device_wait_seen = 0.0  # the engine's device-wait total, last tick
        self._tier_seen: dict[str, float] = {}  # the host tier's totals, last tick
        # Engine-thread side (and `received`): spans and timing, under the lock.
        self._tracks: OrderedDict[str, _Track] = OrderedDict()
        self._lock = threading.Lock()
        # Event-loop side only: span contexts for the batch headers, and how many choices
        # of each request are still to be published.
        self._contexts: OrderedDict[str, tuple[SpanContext, int]] = OrderedDict()

    # -- the event loop -----------------------------------------------------------------
    def received(self, routed: protocol.RoutedRequest) -> None:
        """Call in the handler of `{p}.worker.{id}.run` (its context parents the span)."""
        request = routed.request
        span = self.tracer.start_span(
            genai.SPAN_WORKER,
            kind=SpanKind.CONSUMER,
            attributes={
                genai.REQUEST_ID: request.rid,
                genai.WORKER_ID: self.metrics.worker_id,
                genai.REQUEST_MAX_TOKENS: request.sampling.max_new_tokens,
                genai.USAGE_INPUT_TOKENS: request.prompt_tokens,
            },
        )
        span.add_event(genai.EVENT_QUEUED)
        n = max(request.sampling.n, 1)
        evicted: list[_Track] = []
        with self._lock:
            self._tracks[request.rid] = _Track(span, time.perf_counter(), n)
            while len(self._tracks) > self.max_tracked:
                evicted.append(self._tracks.popitem(last=False)[1])
        for track in evicted:
            track.span.end()
        context = span.get_span_context()
        if context.is_valid:
            self._contexts[request.rid] = (context, n)
            while len(self._contexts) > self.max_tracked:
                self._contexts.popitem(last=False)

    def batch_headers(self, outputs: Sequence[protocol.StepOutput]) -> dict[str, str]:
        """The per-output parents for the detokenizer: one for each output that opens a
        choice (it carries `detok`). Forgets a request once all its choices finished."""
        if not self._contexts:
            return {}
        parents: dict[int, SpanContext] = {}
        for i, out in enumerate(outputs):
            entry = self._contexts.get(out.rid)
            if entry is None:
                continue
            context, left = entry
            if out.detok is not None:
                parents[i] = context
            if out.finish_reason is not None:
                if left <= 1:
                    del self._contexts[out.rid]
                else:
                    self._contexts[out.rid] = (context, left - 1)
        return encode_batch_contexts(parents)

    def forget(self, rid: str) -> None:
        """`rid` will produce no output (refused, or aborted before reaching the engine):
        drop its context and end its span if it is still open."""
        self._contexts.pop(rid, None)
        with self._lock:
            track = self._tracks.pop(rid, None)
        if track is not None:
            track.span.end()

    @contextmanager
    def active(self, rid: str) -> Iterator[None]:
        """Make `rid`'s span the current one (what is sent or spawned inside is its child)."""
        with self._lock:
            track = self._tracks.get(rid)
        if track is None:
            yield
            return
        with use_span(track.span, end_on_exit=False):
            yield

    def observe_load(self, load: EngineLoad) -> float:
        """Set the load gauges; returns the recent cache hit rate (for WorkerStats)."""
        w = self.metrics.label()
        kv = load.kv
        self.metrics.num_running_reqs.labels(**w).set(load.num_running_reqs)
        self.metrics.num_queue_reqs.labels(**w).set(load.num_queue_reqs)
        usage = kv.used_tokens / kv.pool_size if kv.pool_size else 0.0
        self.metrics.token_usage.labels(**w).set(usage)
        rate = self._hit_rate.update(self._hit_total, self._query_total)
        self.metrics.cache_hit_rate.labels(**w).set(rate)
        for kind, total in load.forward_passes.items():
            # The engine keeps totals; the counter advances by what is new since the tick.
            seen = self._passes_seen.get(kind, 0)
            self.metrics.forward_passes.labels(kind=kind, **w).inc(max(total - seen, 0))
            self._passes_seen[kind] = total
        waited = load.device_wait_seconds - self._device_wait_seen
        self.metrics.step_device_wait.labels(**w).inc(max(waited, 0.0))
        self._device_wait_seen = load.device_wait_seconds
        if load.host_cache is not None:
            self._observe_host_tier(load.host_cache)
        return rate

    def _observe_host_tier(self, host: HostCacheStats) -> None:
        m, w = self.metrics, self.metrics.label()
        totals = {
            ("host", "load"): (host.loaded_tokens, host.load_seconds),
            ("host", "write"): (host.written_tokens, host.write_seconds),
            ("host", "drop"): (host.dropped_tokens, None),
            ("store", "load"): (host.store_loaded_tokens, host.store_load_seconds),
            ("store", "write"): (host.store_written_tokens, host.store_write_seconds),
        }
        for (tier, direction), (tokens, seconds) in totals.items():
            labels = {"tier": tier, "direction": direction, **w}
            seen = f"{tier}.{direction}"
            new = tokens - self._tier_seen.get(seen, 0)
            self._tier_seen[seen] = tokens
            m.cache_tier_tokens.labels(**labels).inc(max(new, 0))
            if seconds is None:
                continue
            m.cache_tier_bytes.labels(**labels).inc(max(new, 0) * host.bytes_per_token)
            spent = seconds - self._tier_seen.get(seen + "_s", 0.0)
            self._tier_seen[seen + "_s"] = seconds
            m.cache_tier_seconds.labels(**labels).inc(max(spent, 0.0))
        usage = host.host_used_tokens / host.host_size_tokens if host.host_size_tokens else 0.0
        m.cache_tier_usage.labels(tier="host", **w).set(usage)

    # -- the engine thread ----------------------------------------------------------------
    def rejected(self, rid: str, code: str, message: str) -> None:
        self.metrics.rejected_requests.labels(worker=self.metrics.worker_id, code=code).inc()
        with self._lock:
            track = self._tracks.pop(rid, None)
        if track is not None:
            track.span.set_attribute(genai.ERROR_CODE, code)
            track.span.set_status(Status(StatusCode.ERROR, message))
            track.span.end()

    def resumed(self) -> None:
        """A re-routed request the engine took, continuing from another worker's tokens."""
        self.metrics.resumed_requests.labels(**self.metrics.label()).inc()

    def observe_step(
        self,
        started: float,
        seconds: float,
        batch_size: int,
        outputs: Sequence[protocol.StepOutput],
    ) -> None:
        """One engine step that began at `started` (perf_counter) and took `seconds`."""
        self._step_duration.observe(seconds)
        if batch_size:
            self._batch_size.observe(batch_size)
        self.observe_outputs(started, outputs)

    def observe_outputs(self, started: float, outputs: Sequence[protocol.StepOutput]) -> None:
        """Counters and spans of outputs published by a step that began at `started`
        (or answered without one: an abort before the request reached the engine)."""
        ended: list[_Track] = []
        for out in outputs:
            new_tokens = protocol.num_tokens(out.new_token_ids)
            if new_tokens:
                self._generation.inc(new_tokens)
            finish = out.finish_reason
            if finish is not None:
                self.metrics.finished_requests.labels(
                    worker=self.metrics.worker_id, finish_reason=finish.kind
                ).inc()
                self._query.inc(out.prompt_tokens)
                self._hit.inc(out.cached_tokens)
                self._query_total += out.prompt_tokens
                self._hit_total += out.cached_tokens
            with self._lock:
                track = self._tracks.get(out.rid)
                if track is None:
                    if finish is not None and out.index == 0:
                        self._prompt.inc(out.prompt_tokens)  # untracked: count it anyway
                    continue
                if not track.started and new_tokens:
                    track.started = True
                    self._queue_time.observe(max(started - track.received_at, 0.0))
                    track.span.add_event(genai.EVENT_SCHEDULED, timestamp=_ns_at(started))
                    track.span.add_event(genai.EVENT_FIRST_TOKEN)
                if finish is None:
                    continue
                track.choices_left -= 1
                track.completion_tokens += out.completion_tokens
                track.cached_tokens = max(track.cached_tokens, out.cached_tokens)
                track.finish_reasons.append(finish.kind)
                if track.choices_left > 0:
                    continue
                del self._tracks[out.rid]
            self._prompt.inc(out.prompt_tokens)
            track.span.set_attributes(
                genai.usage_attributes(
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=track.completion_tokens,
                    cached_tokens=track.cached_tokens,
                    finish_reasons=track.finish_reasons,
                )
            )
            ended.append(track)
        for track in ended:
            track.span.end()

    def end_all(self) -> None:
        with self._lock:
            tracks = list(self._tracks.values())
            self._tracks.clear()
        for track in tracks:
            track.span.end()


def _ns_at(perf_counter_s: float) -> int:
    """Wall-clock nanoseconds of a past `perf_counter()` reading (span event timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)
