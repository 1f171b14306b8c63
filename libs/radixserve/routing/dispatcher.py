"""`Dispatcher`: the scheduler service's whole state and every decision it makes.

No I/O: each method takes what arrived (and the time) and returns what to send, so
the service only decodes, calls and publishes, and the tests drive it directly.

    dispatcher = Dispatcher(max_pending_requests=1024, worker_timeout_s=5, retry_after_s=1)
    dispatcher.on_heartbeat(beat, now)           # Heartbeat / WorkerStats keep the registry
    dispatcher.on_kv_events(batch)               # KvEventBatch keeps the cache mirrors
    for worker_id in dispatcher.kv_snapshots_due(now): ...   # send a KvSnapshotRequest
    decision = dispatcher.admit(tokenized, now, time.time())   # Routed | Rejected | Dropped
    worker = dispatcher.abort(rid, now)          # forward to it, or None
    dispatcher.on_finished(rid, index, kind)     # from the workers' step outputs
    moved = dispatcher.expire(now)               # dead workers: their requests re-routed
                                                 # (Routed) or failed 503 worker_lost

A request whose worker dies (its heartbeats stop, it restarts, it does not take the
request) is re-routed to another ready worker with the tokens each of its choices had
generated (`on_progress` keeps them from the workers' step outputs): the new worker
prefills prompt + those tokens for each choice not finished yet and goes on, and its
outputs continue each choice's count, so the client's stream goes on. At most
`max_migrations` times; then, with no other worker ready, or with a hole in what was
seen of a choice, 503 `worker_lost` as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from radixserve.protocol import (
    FinishKind,
    Heartbeat,
    KvEventBatch,
    RequestError,
    RoutedRequest,
    TokenizedRequest,
    WorkerStats,
    WorkerStatus,
    pack_tokens,
    retry_later_error,
    too_large_error,
    unpack_tokens,
)
from radixserve.routing.aborts import RecentAborts
from radixserve.routing.inflight import InflightEntry, InflightTable
from radixserve.routing.kv_mirror import KvMirrors
from radixserve.routing.progress import ChoiceProgress
from radixserve.routing.registry import WorkerRegistry
from radixserve.routing.router import CacheAwareRouter, LeastLoadRouter, Router, WorkerLoad

log = logging.getLogger(__name__)

SERVICE = "scheduler"
QUEUE_FULL = "queue_full"
NO_WORKER = "no_worker"
WORKER_LOST = "worker_lost"
REQUEST_LOST = "request_lost"
# A request its worker's heartbeats have not listed this long has ended there unseen.
UNLISTED_AFTER_S = 3.0
ROUTING_POLICIES = ("cache_aware", "least_load")


@dataclass(frozen=True)
class Routed:
    """Send `routed` to its worker's run subject. `migrated`: why it was re-routed ("" on
    its first route)."""

    routed: RoutedRequest
    migrated: str = ""


@dataclass(frozen=True)
class Rejected:
    """Send `error` to the gateway `gateway_id`."""

    gateway_id: str
    error: RequestError


@dataclass(frozen=True)
class Dropped:
    """Send nothing (the request was aborted already, or is a duplicate)."""

    reason: str


Decision = Routed | Rejected | Dropped


class Dispatcher:
    """`routing` picks the router ("cache_aware": a `CacheAwareRouter` over
    `kv_mirrors`, fed by `on_kv_events`; "least_load": no mirrors, events ignored)
    unless `router` is given; a given `CacheAwareRouter`'s mirrors are fed."""

    def __init__(
        self,
        *,
        max_pending_requests: int,
        worker_timeout_s: float,
        retry_after_s: float,
        routing: str = "cache_aware",
        router: Router | None = None,
        abort_memory_s: float = 60.0,
        max_migrations: int = 2,
    ) -> None:
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        if routing not in ROUTING_POLICIES:
            raise ValueError(
                f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}"
            )
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self.max_pending_requests = max_pending_requests
        self.max_migrations = max_migrations
        self.retry_after_s = retry_after_s
        self.kv_mirrors: KvMirrors | None = None
        if router is None and routing == "cache_aware":
            router = CacheAwareRouter(KvMirrors())
        if isinstance(router, CacheAwareRouter):
            self.kv_mirrors = router.mirrors
        self.router: Router = router or LeastLoadRouter()
        self.workers = WorkerRegistry(worker_timeout_s)
        self.inflight = InflightTable()
        self.early_aborts = RecentAborts(ttl_s=abort_memory_s)

    # -- what workers report --------------------------------------------------------

    def on_heartbeat(self, beat: Heartbeat, now: float) -> list[Routed | Rejected]:
        """Keep the worker alive; if it restarted, what it held is re-routed or lost."""
        if self.kv_mirrors is not None:
            self.kv_mirrors.on_heartbeat(beat)
        if not self.workers.on_heartbeat(beat, now):
            self._adopt(beat)
            if beat.status == WorkerStatus.STOPPING:
                # Drained: what it still holds (handed off, not finished) goes on elsewhere.
                return self._lose(
                    beat.worker_id, f"worker {beat.worker_id} stopped", "worker_drained"
                )
            return self._unlisted(beat, now)
        log.warning("worker %s restarted (epoch %d)", beat.worker_id, beat.epoch)
        return self._lose(beat.worker_id, f"worker {beat.worker_id} restarted", "worker_restarted")

    def observe_heartbeat(self, beat: Heartbeat, now: float) -> None:
        """A standby scheduler's half of `on_heartbeat`: the worker's liveness and cache
        mirror, not its requests (the active scheduler's until this one takes over)."""
        if self.kv_mirrors is not None:
            self.kv_mirrors.on_heartbeat(beat)
        self.workers.on_heartbeat(beat, now)

    def hand_over(self) -> None:
        """This scheduler stepped down: what it had in flight is the new active one's,
        which adopts it from the workers' heartbeats."""
        self.inflight = InflightTable()

    def on_stats(self, stats: WorkerStats, now: float) -> None:
        self.workers.on_stats(stats, now)

    def on_kv_events(self, batch: KvEventBatch) -> None:
        """Update the worker's cache mirror. A worker the registry does not know (expired,
        or not heard from yet) is ignored: its first heartbeat starts its mirror, which
        asks for a snapshot if batches were published before."""
        if self.kv_mirrors is not None and batch.worker_id in self.workers:
            self.kv_mirrors.on_events(batch)

    def kv_snapshots_due(self, now: float) -> list[str]:
        """Workers to send a `KvSnapshotRequest` now (their mirror is stale)."""
        return [] if self.kv_mirrors is None else self.kv_mirrors.snapshots_due(now)

    def on_progress(self, progress: ChoiceProgress) -> bool:
        """One choice's step output: its tokens kept (for a re-route), and True when it
        finished the whole request."""
        entry = self.inflight.get(progress.rid)
        if entry is not None:
            entry.on_progress(progress.index, progress.new_token_ids, progress.completion_tokens)
        if progress.finish is None:
            return False
        return self.on_finished(progress.rid, progress.index, progress.finish)

    def on_finished(self, rid: str, index: int, kind: FinishKind) -> bool:
        """A choice finished; True when that finished the whole request."""
        return self.inflight.finish_choice(rid, index, whole=kind == "abort") is not None

    def on_error(self, rid: str) -> str | None:
        """A `RequestError` for `rid` reached its gateway: the request is over. The worker
        it was in flight on (None if it was not), which must be told unless it sent it."""
        entry = self.inflight.remove(rid)
        return None if entry is None else entry.worker_id

    def expire(self, now: float) -> list[Routed | Rejected]:
        """Drop workers silent for `worker_timeout_s`; what they held is re-routed or
        gets 503 `worker_lost`."""
        self.early_aborts.prune(now)
        lost: list[Routed | Rejected] = []
        for worker_id in self.workers.expire(now):
            log.warning("worker %s missed its heartbeats; dropped", worker_id)
            if self.kv_mirrors is not None:
                self.kv_mirrors.drop(worker_id)
            lost += self._lose(
                worker_id,
                f"worker {worker_id} stopped answering (no heartbeat for "
                f"{self.workers.timeout_s:g}s)",
                "worker_lost",
            )
        return lost

    # -- requests ----------------------------------------------------------------------

    def admit(self, request: TokenizedRequest, now: float, wall_time: float) -> Decision:
        """Route `request` to a worker, or say why not."""
        rid = request.rid
        if self.early_aborts.consume(rid, now):
            return Dropped("aborted before it was routed")
        if rid in self.inflight:
            return Dropped("already in flight (a duplicate)")
        if len(self.inflight) >= self.max_pending_requests:
            return self._reject(
                request,
                429,
                QUEUE_FULL,
                f"{len(self.inflight)} requests are in progress, the server's limit; retry later",
                "rate_limit_error",
            )
        ready = [
            WorkerLoad(state.worker_id, state.load, self.inflight.count_on(state.worker_id))
            for state in self.workers.ready()
        ]
        route = self.router.pick(request, ready)
        if route is None:
            return self._reject(
                request, 503, NO_WORKER, "no worker is ready to serve the request", "server_error"
            )
        self.workers.note_routed(route.worker_id)
        self.inflight.add(
            InflightEntry(
                rid=rid,
                worker_id=route.worker_id,
                gateway_id=request.gateway_id,
                choices=max(request.sampling.n, 1),
                routed_at=wall_time,
                request=request,
            )
        )
        routed = RoutedRequest(
            request=request,
            worker_id=route.worker_id,
            expected_cached_tokens=route.expected_cached_tokens,
            routed_at=wall_time,
        )
        return Routed(routed)

    def unroute(self, rid: str, why: str, *, too_large: bool = False) -> Rejected | None:
        """The request routed to a worker never reached it (its publish failed): it is no
        longer in flight, and its gateway gets a 503 to retry, or with `too_large` (past
        the bus's payload limit) a 413 (None if it is not in flight)."""
        entry = self.inflight.remove(rid)
        if entry is None:
            return None
        if too_large:
            return Rejected(entry.gateway_id, too_large_error(rid, SERVICE, "to a worker"))
        return Rejected(entry.gateway_id, self._error(entry, why))

    def not_taken(self, rid: str, worker_id: str, why: str) -> Routed | Rejected | None:
        """`worker_id` did not take `rid` (no responder, no acknowledgement): re-routed
        elsewhere, or out of flight with a 503; None when it is no longer `worker_id`'s."""
        entry = self.inflight.get(rid)
        if entry is None or entry.worker_id != worker_id:
            return None
        routed = self._migrate(entry, "not_acknowledged")
        if routed is not None:
            return routed
        self.inflight.remove(rid)
        return Rejected(entry.gateway_id, self._error(entry, why))

    def abort(self, rid: str, now: float) -> str | None:
        """The worker to forward the abort to; None when the request is not in flight
        (then it is remembered a while, in case the request itself is still coming)."""
        entry = self.inflight.get(rid)
        if entry is not None:
            return entry.worker_id
        self.early_aborts.add(rid, now)
        return None

    def ready_workers(self) -> list[str]:
        return sorted(state.worker_id for state in self.workers.ready())

    # -- internals ---------------------------------------------------------------------

    def _adopt(self, beat: Heartbeat) -> None:
        """Requests a worker runs that this scheduler does not know (it restarted since
        they were routed) enter the in-flight table, so aborts reach them and the bound
        counts them. Without their prompt they cannot be re-routed."""
        for held in beat.requests:
            if held.rid in self.inflight or self.inflight.ended_ago(held.rid) is not None:
                continue
            log.info("adopted from worker %s", beat.worker_id, extra={"rid": held.rid})
            self.inflight.add(
                InflightEntry(
                    rid=held.rid,
                    worker_id=beat.worker_id,
                    gateway_id=held.gateway_id,
                    choices=max(held.choices, 1),
                    routed_at=beat.time,
                )
            )

    def _unlisted(self, beat: Heartbeat, now: float) -> list[Routed | Rejected]:
        """Requests held for this worker that its heartbeats have stopped listing for
        UNLISTED_AFTER_S: it ended them and their ends were lost (a NATS outage): 503
        `request_lost` now rather than a client waiting for its deadline."""
        if not beat.requests_listed:
            return []
        listed = {held.rid for held in beat.requests}
        decisions: list[Routed | Rejected] = []
        for entry in self.inflight.held_by(beat.worker_id):
            if entry.rid in listed:
                entry.unlisted_since = None
            elif entry.unlisted_since is None:
                entry.unlisted_since = now  # maybe its last output is still on its way
            elif now - entry.unlisted_since >= UNLISTED_AFTER_S:
                log.warning(
                    "worker %s no longer runs it, and its end never came: failing it",
                    beat.worker_id,
                    extra={"rid": entry.rid},
                )
                self.inflight.remove(entry.rid)
                decisions.append(Rejected(entry.gateway_id, self._lost_end(entry)))
        return decisions

    def _lose(self, worker_id: str, why: str, reason: str) -> list[Routed | Rejected]:
        decisions: list[Routed | Rejected] = []
        for entry in self.inflight.held_by(worker_id):
            routed = self._migrate(entry, reason)
            if routed is not None:
                decisions.append(routed)
                continue
            self.inflight.remove(entry.rid)
            decisions.append(Rejected(entry.gateway_id, self._error(entry, why)))
        return decisions

    def _migrate(self, entry: InflightEntry, reason: str) -> Routed | None:
        """Re-route `entry` to another ready worker with what it generated, if it can go."""
        request = entry.request
        if request is None or entry.attempt >= self.max_migrations:
            return None
        ready = [
            WorkerLoad(state.worker_id, state.load, self.inflight.count_on(state.worker_id))
            for state in self.workers.ready()
            if state.worker_id != entry.worker_id
        ]
        prefixes = entry.prefixes()
        running = [prefix for prefix in prefixes if prefix is not None]
        # Routed by prompt + the longest choice's tokens: what the new worker's cache may
        # hold most of.
        longest = max(running, key=len)
        whole = pack_tokens([*unpack_tokens(request.input_ids), *unpack_tokens(longest)])
        route = self.router.pick(msgspec.structs.replace(request, input_ids=whole), ready)
        if route is None:
            return None
        log.warning(
            "re-routing from %s to %s after %d tokens (%s, attempt %d, %d choices to go)",
            entry.worker_id,
            route.worker_id,
            sum(len(prefix) for prefix in running) // 4,
            reason,
            entry.attempt + 1,
            len(running),
            extra={"rid": entry.rid},
        )
        self.inflight.move(entry.rid, route.worker_id)
        self.workers.note_routed(route.worker_id)
        entry.attempt += 1
        routed = RoutedRequest(
            request=request,
            worker_id=route.worker_id,
            expected_cached_tokens=route.expected_cached_tokens,
            routed_at=time.time(),
            attempt=entry.attempt,
            # One choice: its tokens as before; n > 1: each choice's, None once finished.
            output_prefix=(prefixes[0] or None) if entry.choices == 1 else None,
            choice_prefixes=prefixes if entry.choices > 1 else None,
        )
        return Routed(routed, migrated=reason)

    def _error(self, entry: InflightEntry, why: str) -> RequestError:
        message = f"{why}; the request was lost, retry it"
        return retry_later_error(entry.rid, WORKER_LOST, message, SERVICE, self.retry_after_s)

    def _lost_end(self, entry: InflightEntry) -> RequestError:
        message = (
            f"worker {entry.worker_id} finished the request, but its end was lost on the "
            "way (the message bus restarted?); retry it"
        )
        return retry_later_error(entry.rid, REQUEST_LOST, message, SERVICE, self.retry_after_s)

    def _reject(
        self, request: TokenizedRequest, status: int, code: str, message: str, error_type: str
    ) -> Rejected:
        error = RequestError(
            rid=request.rid,
            code=code,
            message=message,
            http_status=status,
            error_type=error_type,
            service=SERVICE,
            retry_after_s=self.retry_after_s,
        )
        return Rejected(request.gateway_id, error)
