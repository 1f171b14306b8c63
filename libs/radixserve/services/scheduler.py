"""scheduler service: routes each `TokenizedRequest` to a worker (docs/request-path.md, hop 3).

Keeps the live workers from their heartbeats and stats and a mirror of each one's radix
cache from its KV events (asking a worker for a snapshot when its mirror missed a
batch), sends each request to the worker caching the longest prefix of its prompt while
loads are balanced, else to the least loaded one (`--routing`), remembers rid -> worker
until the request finishes (seen in the workers' step outputs), forwards aborts, fans
`flush_cache` out, and answers 429 / 503 when it cannot take a request. Every decision is
`radixserve.routing`'s; this file only moves messages.

Takes `{p}.schedule` (acknowledged on receipt), `{p}.abort`, `{p}.flush_cache` and
`{p}.scheduler.inflight` in the queue group `scheduler`; hears `{p}.heartbeat.*`,
`{p}.stats.*`, `{p}.kv_events.*`, `{p}.detok` and `{p}.gateway.*.errors` (a request failed
by another service than its worker is aborted there). Sends `RoutedRequest` on
`{p}.worker.{id}.run` with a reply subject the worker acknowledges. Errors, all with
`retry_after_s` (`--retry-after-s`): 429 `queue_full` past `--max-pending-requests`
unfinished, 503 `no_worker` when none is ready, 503 `worker_lost` for a worker's requests
once it is silent for `--worker-timeout-s` (or restarted) and for a run not acknowledged
within `--worker-ack-timeout-s`.

One instance serves: it holds the in-flight table and the load estimates. With
`--ha-lease`, several replicas run; the one holding a lease in Redis (store/lease.py)
takes the queue-group subjects, and the others stand by: they hear the broadcast
subjects (their worker registry and cache mirrors stay current) but take no request.
A standby that wins the lease (its holder's renewals stopped for `--ha-lease-ttl-s`, or
it released it on SIGTERM) subscribes and adopts what is in flight from the workers'
heartbeats; an active one that finds another holder steps down and leaves its requests
to it. Redis down changes nothing for the active one; a standby cannot take over then.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from radixserve.bus import (
    BusError,
    BusMsg,
    BusNoResponders,
    BusPayloadTooLarge,
    BusSubscription,
    BusTimeout,
)
from radixserve.protocol import (
    RUN_REFUSED_HEADER,
    AbortRequest,
    FlushCacheReply,
    FlushCacheRequest,
    Heartbeat,
    InflightQuery,
    InflightReply,
    KvEventBatch,
    KvSnapshotRequest,
    ProtocolError,
    QueueGroups,
    RequestError,
    TokenizedRequest,
    WorkerStats,
    decode,
    encode,
)
from radixserve.routing import (
    ROUTING_POLICIES,
    Dispatcher,
    Dropped,
    PendingAcks,
    Rejected,
    Routed,
    merge_flush_replies,
    step_progress,
)
from radixserve.services.messages import decode_or_drop
from radixserve.services.runtime import (
    ServiceContext,
    ServiceSettings,
    flag_from_env,
    seconds_from_env,
    settings_from_args,
)
from radixserve.store import Store
from radixserve.store.lease import Lease, LeaseKeeper
from radixserve.telemetry import genai
from radixserve.telemetry.pipeline_metrics import SchedulerMetrics
from radixserve.telemetry.tracing import get_tracer

log = logging.getLogger(__name__)

SERVICE = "scheduler"
ENV_MAX_MIGRATIONS = "RADIXSERVE_MAX_MIGRATIONS"
ENV_HA_LEASE = "RADIXSERVE_HA_LEASE"
ENV_HA_LEASE_TTL_S = "RADIXSERVE_HA_LEASE_TTL_S"
STANDBY = "standby"  # its ServiceHeartbeat status while another replica serves
DEFAULT_HA_LEASE_TTL_S = 3.0  # a SIGKILL'd active one replaced within TTL * 7/6: 3.5 s
# On SIGTERM, from the standby's winning the lease to this one's unsubscribing: the
# winner's subscriptions (milliseconds) are in place first.
HANDOVER_GRACE_S = 0.2
_tracer = get_tracer(SERVICE)
# The status NATS puts on a reply when nobody listens on the subject (a header).
NO_RESPONDERS = "503"


@dataclass(frozen=True)
class SchedulerSettings:
    service: ServiceSettings
    max_pending_requests: int = 1024
    worker_timeout_s: float = 5.0
    retry_after_s: float = 1.0
    flush_timeout_s: float = 5.0  # per worker, all at once
    # A run message a worker has not acknowledged within this long was lost: 503.
    worker_ack_timeout_s: float = 10.0
    routing: str = "cache_aware"  # or least_load (routing.ROUTING_POLICIES)
    # Re-routes of a request whose worker dies (with the tokens it generated); then 503.
    max_migrations: int = 2
    # Active/standby replicas: the holder of a Redis lease serves (None: no lease, one
    # scheduler, no Redis). A standby takes over within the TTL of the active's end.
    ha_lease_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_pending_requests < 1:
            raise ValueError("--max-pending-requests must be >= 1")
        if self.worker_timeout_s <= 0 or self.flush_timeout_s <= 0:
            raise ValueError("--worker-timeout-s and the flush timeout must be > 0")
        if self.retry_after_s < 0:
            raise ValueError("--retry-after-s must be >= 0")
        if self.worker_ack_timeout_s <= 0:
            raise ValueError("--worker-ack-timeout-s must be > 0")
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if self.ha_lease_ttl_s is not None and not self.ha_lease_ttl_s >= 0.3:
            raise ValueError(f"--ha-lease-ttl-s must be >= 0.3, got {self.ha_lease_ttl_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="unfinished requests at most; more get 429 queue_full",
    )
    parser.add_argument(
        "--worker-timeout-s",
        type=float,
        default=5.0,
        help="a worker without a heartbeat for this long is dead",
    )
    parser.add_argument(
        "--retry-after-s", type=float, default=1.0, help="Retry-After of 429 / 503 answers"
    )
    parser.add_argument(
        "--worker-ack-timeout-s",
        type=float,
        default=10.0,
        help="a request whose worker has not acknowledged it within this long gets 503",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=int(os.environ.get(ENV_MAX_MIGRATIONS, "") or 2),
        help="a request whose worker dies is re-routed, with the tokens it generated, to "
        "another worker this many times at most, then gets 503 worker_lost (0: never; "
        f"default ${ENV_MAX_MIGRATIONS} or 2)",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="cache_aware",
        help="cache_aware: the worker caching the longest prefix of the prompt (from its KV "
        "events) while loads are balanced, else the least loaded; least_load: load only",
    )
    parser.add_argument(
        "--ha-lease",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run as one of several replicas: the one holding a lease in Redis serves, the "
        "others stand by and take over once it ends (default $" + ENV_HA_LEASE + " or off: "
        "one scheduler, no Redis)",
    )
    parser.add_argument(
        "--ha-lease-ttl-s",
        type=float,
        default=None,
        help="with --ha-lease: a lease not renewed for this long is taken by a standby; "
        f"renewed every third of it (default ${ENV_HA_LEASE_TTL_S} or "
        f"{DEFAULT_HA_LEASE_TTL_S:g})",
    )


def settings_from(ns: argparse.Namespace) -> SchedulerSettings:
    ha_lease = ns.ha_lease if ns.ha_lease is not None else flag_from_env(os.environ, ENV_HA_LEASE)
    ttl_s = ns.ha_lease_ttl_s
    if ttl_s is None:
        ttl_s = seconds_from_env(os.environ, ENV_HA_LEASE_TTL_S, DEFAULT_HA_LEASE_TTL_S)
    return SchedulerSettings(
        service=settings_from_args(SERVICE, ns),
        max_pending_requests=ns.max_pending_requests,
        worker_timeout_s=ns.worker_timeout_s,
        retry_after_s=ns.retry_after_s,
        worker_ack_timeout_s=ns.worker_ack_timeout_s,
        routing=ns.routing,
        max_migrations=ns.max_migrations,
        ha_lease_ttl_s=ttl_s if ha_lease else None,
    )


def lease_keeper(
    service: ServiceSettings,
    ttl_s: float,
    metrics: SchedulerMetrics,
    *,
    on_won: Callable[[], Awaitable[None]],
    on_lost: Callable[[str], Awaitable[None]],
) -> LeaseKeeper:
    """The keeper of this deployment's scheduler lease (one per subject prefix). Redis is
    not waited for: a claim that fails is counted, and tried again."""
    lease = Lease(
        Store(service.store_settings()),
        f"{service.subject_prefix}:{SERVICE}",
        holder=service.instance_id,
        ttl_s=ttl_s,
    )
    return LeaseKeeper(
        lease, on_won=on_won, on_lost=on_lost, on_error=lambda exc: metrics.lease_errors.inc()
    )


async def start(ctx: ServiceContext, settings: SchedulerSettings) -> None:
    dispatcher = Dispatcher(
        max_pending_requests=settings.max_pending_requests,
        worker_timeout_s=settings.worker_timeout_s,
        retry_after_s=settings.retry_after_s,
        routing=settings.routing,
        max_migrations=settings.max_migrations,
    )
    bus, subjects = ctx.bus, ctx.subjects
    metrics = SchedulerMetrics(ctx.metrics)
    acks = PendingAcks(settings.worker_ack_timeout_s)
    scheduler_id = settings.service.instance_id

    def update_load() -> None:
        metrics.set_load(len(dispatcher.inflight), len(dispatcher.ready_workers()))

    async def send_errors(rejected: list[Rejected]) -> None:
        """Never raises: a failed publish (NATS gone past the reconnect buffer) is logged,
        and the gateway's deadline answers that client; the callers (the expiry loop
        among them) go on."""
        for item in rejected:
            metrics.observe_rejected(item.error.code)
            try:
                await bus.publish(subjects.gateway_errors(item.gateway_id), encode(item.error))
            except (BusError, ValueError) as exc:
                log.error(
                    "%s not sent to gateway %r: %r",
                    item.error.code,
                    item.gateway_id,
                    exc,
                    extra={"rid": item.error.rid},
                )

    async def send_routed(decision: Routed) -> None:
        """Publish a run to its worker, which acknowledges it to `on_ack`. Not sent (too
        large, NATS unreachable past its reconnect buffer): no worker holds it, so it
        must not hold a place in flight, and its gateway hears why."""
        routed, rid = decision.routed, decision.routed.rid
        metrics.observe_routed(routed.worker_id, routed.expected_cached_tokens)
        if decision.migrated:
            metrics.observe_migrated(decision.migrated)
        token = acks.sent(rid, routed.worker_id, time.monotonic())
        try:
            await bus.publish(
                subjects.worker_run(routed.worker_id),
                encode(routed),
                reply=subjects.scheduler_ack(scheduler_id, token),
            )
        except BusError as exc:
            acks.acked(token)
            log.error("not sent to %s: %r", routed.worker_id, exc, extra={"rid": rid})
            lost = dispatcher.unroute(
                rid,
                f"the request could not be sent to worker {routed.worker_id}",
                too_large=isinstance(exc, BusPayloadTooLarge),
            )
            if lost is not None:
                await send_errors([lost])

    async def settle(decisions: list[Routed | Rejected]) -> None:
        """What a lost worker's requests became: re-routed, or 503s to their gateways."""
        for decision in decisions:
            if isinstance(decision, Routed):
                await send_routed(decision)
            else:
                await send_errors([decision])

    async def on_schedule(msg: BusMsg) -> None:
        await bus.acknowledge(msg)  # received: the tokenizer stops waiting for it
        request = decode_or_drop(msg, TokenizedRequest, log, level=logging.ERROR)
        if request is None:
            return
        # Parent: the tokenizer's span; the worker's span continues from this one.
        with _tracer.start_as_current_span(
            genai.SPAN_SCHEDULE, attributes={genai.REQUEST_ID: request.rid}
        ) as span:
            decision = dispatcher.admit(request, time.monotonic(), time.time())
            if isinstance(decision, Routed):
                log.debug("routed to %s", decision.routed.worker_id, extra={"rid": request.rid})
                span.set_attribute(genai.WORKER_ID, decision.routed.worker_id)
                await send_routed(decision)
            elif isinstance(decision, Rejected):
                log.info("rejected: %s", decision.error.code, extra={"rid": request.rid})
                span.set_attribute(genai.ERROR_CODE, decision.error.code)
                await send_errors([decision])
            elif isinstance(decision, Dropped):
                log.info("dropped: %s", decision.reason, extra={"rid": request.rid})
        update_load()

    async def on_abort(msg: BusMsg) -> None:
        abort = decode_or_drop(msg, AbortRequest, log)
        if abort is None:
            return
        worker_id = dispatcher.abort(abort.rid, time.monotonic())
        if worker_id is not None:
            await bus.publish(subjects.worker_abort(worker_id), encode(abort))

    async def flush_one(worker_id: str, data: bytes) -> FlushCacheReply | str:
        try:
            with ctx.metrics.time_nats("worker.flush_cache"):
                raw = await bus.request(
                    subjects.worker_flush_cache(worker_id), data, timeout_s=settings.flush_timeout_s
                )
            return decode(raw.data, FlushCacheReply)
        except BusTimeout:
            return f"no reply within {settings.flush_timeout_s:g}s"
        except BusNoResponders:
            return "not listening"
        except (BusError, ProtocolError) as exc:
            return f"failed: {exc}"

    async def on_flush(msg: BusMsg) -> None:
        request = decode_or_drop(msg, FlushCacheRequest, log)
        if request is None:
            return
        workers = dispatcher.ready_workers()
        data = encode(request)
        replies = await asyncio.gather(*(flush_one(worker_id, data) for worker_id in workers))
        reply = merge_flush_replies(request.rid, dict(zip(workers, replies, strict=True)))
        log.info("flush_cache: %s", reply.message, extra={"rid": request.rid})
        if msg.reply:
            await bus.respond(msg, encode(reply))

    async def on_inflight(msg: BusMsg) -> None:
        query = decode_or_drop(msg, InflightQuery, log)
        if query is None:
            return
        table = dispatcher.inflight
        inflight: list[str] = []
        ended: dict[str, float] = {}
        for rid in query.rids:
            if rid in table:
                inflight.append(rid)
            elif (ago := table.ended_ago(rid)) is not None:
                ended[rid] = ago
        if msg.reply:
            await bus.respond(msg, encode(InflightReply(inflight=inflight, ended=ended)))

    async def on_heartbeat(msg: BusMsg) -> None:
        beat = decode_or_drop(msg, Heartbeat, log)
        if beat is None:
            return
        if keeper is None or keeper.held:
            await settle(dispatcher.on_heartbeat(beat, time.monotonic()))
        else:  # a standby: its requests are the active scheduler's
            dispatcher.observe_heartbeat(beat, time.monotonic())

    async def on_stats(msg: BusMsg) -> None:
        stats = decode_or_drop(msg, WorkerStats, log)
        if stats is None:
            return
        dispatcher.on_stats(stats, time.monotonic())

    async def on_kv_events(msg: BusMsg) -> None:
        batch = decode_or_drop(msg, KvEventBatch, log)
        if batch is None:
            return
        dispatcher.on_kv_events(batch)

    async def ask_snapshots(now: float) -> None:
        """A worker whose mirror missed a batch resends its whole cache on kv_events."""
        for worker_id in dispatcher.kv_snapshots_due(now):
            request = KvSnapshotRequest(worker_id=worker_id, reason="the mirror missed a batch")
            metrics.observe_kv_snapshot(worker_id)
            try:
                await bus.publish(subjects.worker_kv_snapshot(worker_id), encode(request))
            except BusError as exc:  # asked again after the retry interval
                log.warning("KV snapshot request to %s not sent: %r", worker_id, exc)

    async def on_step_outputs(msg: BusMsg) -> None:
        try:
            progress = step_progress(msg.data)
        except ProtocolError as exc:
            log.warning("malformed StepOutputBatch: %s", exc)
            return
        for choice in progress:
            dispatcher.on_progress(choice)

    async def on_request_error(msg: BusMsg) -> None:
        # A request that failed after routing never finishes on `detok`; its error to the
        # gateway is the sign it is over. Failed by the worker (it refused it), it is gone
        # there; failed by another service (the detokenizer's output_lost), the worker is
        # still generating it: abort it there. This handler may run before `on_abort` for
        # the sender's own abort, which then finds the request out of flight.
        error = decode_or_drop(msg, RequestError, log, level=logging.DEBUG)
        if error is None:
            return
        worker_id = dispatcher.on_error(error.rid)
        if worker_id is None or error.service == "worker":
            return
        abort = AbortRequest(rid=error.rid, reason=error.code or "failed")
        try:
            await bus.publish(subjects.worker_abort(worker_id), encode(abort))
        except (BusError, ValueError) as exc:  # it finishes on its own, unread
            log.error("abort after %s not sent: %r", error.code, exc, extra={"rid": error.rid})

    async def lose(rid: str, worker_id: str, why: str) -> None:
        """A run that never reached its worker: re-routed to another, or out of flight
        with a 503 to its gateway; and an abort to that worker in case it arrives late."""
        decision = dispatcher.not_taken(rid, worker_id, why)
        if decision is None:
            return  # finished, aborted or re-routed meanwhile
        log.error("%s", why, extra={"rid": rid})
        await settle([decision])
        try:
            abort = AbortRequest(rid=rid, reason="not_acknowledged")
            await bus.publish(subjects.worker_abort(worker_id), encode(abort))
        except BusError as exc:
            log.warning("abort not sent to %s: %r", worker_id, exc, extra={"rid": rid})
        update_load()

    async def on_ack(msg: BusMsg) -> None:
        sent = acks.acked(msg.subject.rsplit(".", 1)[-1])
        if sent is None:
            return
        rid, worker_id = sent
        if msg.headers.get("Status") == NO_RESPONDERS:
            await lose(rid, worker_id, f"worker {worker_id} does not listen for requests")
        elif refused := msg.headers.get(RUN_REFUSED_HEADER):
            await lose(rid, worker_id, f"worker {worker_id} refused the request ({refused})")

    async def expire_workers() -> None:
        interval_s = min(1.0, settings.worker_timeout_s / 4, settings.worker_ack_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            await settle(dispatcher.expire(now))
            await ask_snapshots(now)
            for rid, worker_id in acks.expired(now):
                timeout_s = settings.worker_ack_timeout_s
                why = f"worker {worker_id} did not acknowledge the request within {timeout_s:g} s"
                await lose(rid, worker_id, why)
            update_load()

    serving: list[BusSubscription] = []

    async def serve() -> None:
        """Take the queue group's subjects: from now on this instance routes."""
        for subject, handler in (
            (subjects.schedule, on_schedule),
            (subjects.abort, on_abort),
            (subjects.flush_cache, on_flush),
            (subjects.scheduler_inflight, on_inflight),
        ):
            serving.append(await bus.subscribe(subject, handler, queue=QueueGroups.SCHEDULER))
        ctx.status = "ready"
        metrics.active.set(1)

    async def stop_serving() -> None:
        """Route what is queued and take nothing new (the first one is `schedule`)."""
        subscriptions = serving[:]
        serving.clear()
        for subscription in subscriptions:
            await subscription.drain()

    async def take_over() -> None:
        if ctx.status == STANDBY:
            metrics.failovers.inc()
            log.warning("took over: this scheduler is the active one now")
        await serve()

    async def step_down(holder: str) -> None:
        await stop_serving()
        dispatcher.hand_over()  # the new active one adopts them from the heartbeats
        ctx.status = STANDBY
        metrics.active.set(0)
        update_load()

    keeper: LeaseKeeper | None = None
    if settings.ha_lease_ttl_s is not None:
        keeper = lease_keeper(
            settings.service,
            settings.ha_lease_ttl_s,
            metrics,
            on_won=take_over,
            on_lost=step_down,
        )
    # Worker state first, so the first requests already see the workers.
    await bus.subscribe(subjects.heartbeat_all, on_heartbeat)
    await bus.subscribe(subjects.stats_all, on_stats)
    await bus.subscribe(subjects.kv_events_all, on_kv_events)
    await bus.subscribe(subjects.detok, on_step_outputs)
    await bus.subscribe(subjects.gateway_errors_all, on_request_error)
    await bus.subscribe(subjects.scheduler_acks(scheduler_id), on_ack)
    if keeper is None:
        await serve()
    else:
        holder = await keeper.step()  # free (a lone replica, a first start): serve at once
        if not keeper.held:
            log.info("standing by; the lease is held by %s", holder or "? (Redis unreachable)")
            ctx.status = STANDBY
            metrics.active.set(0)
        ctx.spawn(keeper.run(), "lease")
    ctx.spawn(expire_workers(), "expire-workers")

    async def drain() -> None:
        if keeper is None:
            await serving[0].drain()  # route what is queued; take nothing new
            return
        # Keep serving until a standby holds the lease: no request finds no scheduler.
        await keeper.release()
        taker = await keeper.wait_taken(keeper.lease.ttl_s)
        log.info("handed over to %s", taker or "nobody (no standby took the lease)")
        if taker is not None:
            await asyncio.sleep(HANDOVER_GRACE_S)
        await stop_serving()
        await keeper.lease.store.close()

    ctx.on_drain(drain)
