"""worker: owns the engine (model, KV pool, radix cache) and runs routed requests.

Subscribes `{p}.worker.{id}.>` (run, abort, flush_cache, kv_snapshot) and
`{p}.detok_resync` (a detokenizer that lost its state gets the asked requests' whole
output in the next batch's `resent`, finished ones of the last 30 s too); the engine runs
in its own thread (`radixserve.worker.driver`) and hands back one `StepOutputBatch` per
step, published on `{p}.detok`. Publishes `Heartbeat` ("starting" while the model loads,
then "ready") and `WorkerStats` every second, and its radix cache's changes as
`KvEventBatch`es on `{p}.kv_events.{id}` (numbered; the whole cache again when the
scheduler asks), from which the scheduler routes by prefix. A constrained request's
grammar comes from `{p}.grammar.fetch` (compiled here without an answer). Bad sampling
parameters are answered with a `RequestError` 400 naming the field. Flags: every
`EngineConfig` field (or `RADIXSERVE_<FIELD>`), plus `--engine-stall-s`. Scale by
replicas, one engine each. On SIGTERM: heartbeat "draining" (the scheduler routes
nothing new), new requests are handed back with a 503, running ones finish (within 60%
of the drain timeout, `--drain-timeout-s`) and the rest are handed to other workers:
stopped here without a finish, then the "stopping" heartbeat, on which the scheduler
re-routes them with the tokens they had generated.

A hung engine (one step running past `--engine-stall-s`, 300 s: a stuck device, a
deadlock) stops the worker with exit code 1, after logging where the engine thread
is: its heartbeats would otherwise go on while every request it holds waits out its
timeout. The scheduler then fails the worker's requests, and its supervisor restarts it.
So does a lost tensor-parallel rank (`Engine.failure()`), at once, even while idle.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve import protocol
from radixserve.bus import BusError, BusMsg
from radixserve.engine.flags import add_engine_arguments, engine_kwargs
from radixserve.services.messages import decode_or_drop
from radixserve.services.runtime import ServiceContext, ServiceSettings, settings_from_args
from radixserve.telemetry.tracing import get_tracer
from radixserve.worker.metrics import WorkerMetrics, WorkerTelemetry

if TYPE_CHECKING:
    from radixserve.worker.driver import EngineDriver

log = logging.getLogger("radixserve.worker")

SERVICE = "worker"
STATS_INTERVAL_S = 1.0
GRAMMAR_FETCH_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 10.0  # the engine's answer to flush_cache (it flushes between steps)


DEFAULT_ENGINE_STALL_S = 300.0  # above any one step, first-use kernel compiles included


@dataclass(frozen=True)
class WorkerSettings:
    service: ServiceSettings
    # The EngineConfig keyword arguments given by flags or variables (engine.flags).
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    engine_stall_s: float = DEFAULT_ENGINE_STALL_S  # 0: never


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument(
        "--engine-stall-s",
        type=float,
        default=DEFAULT_ENGINE_STALL_S,
        help="stop the worker (exit 1) when one engine step runs this long: a hung "
        f"engine (default {DEFAULT_ENGINE_STALL_S:g}; 0 = never)",
    )


def settings_from(ns: argparse.Namespace) -> WorkerSettings:
    service = settings_from_args(SERVICE, ns)
    engine_options = engine_kwargs(ns)
    if ns.engine_stall_s < 0:
        raise SystemExit(f"--engine-stall-s must be >= 0, got {ns.engine_stall_s:g}")
    return WorkerSettings(
        service=service, engine_options=engine_options, engine_stall_s=ns.engine_stall_s
    )


async def start(ctx: ServiceContext, settings: WorkerSettings) -> None:
    await WorkerService(
        ctx, settings.engine_options, engine_stall_s=settings.engine_stall_s
    ).start()


def engine_failure(driver: EngineDriver, stall_s: float) -> str | None:
    """Why the worker must stop because of its engine thread (failed, gone, or one step
    running past `stall_s`, 0 = no limit), or None while it is fine."""
    if driver.error is not None:
        return f"the engine thread failed: {driver.error!r}"
    lost = driver.engine.failure()  # idle, the engine thread would not learn of it
    if lost is not None:
        return f"the engine cannot go on: {lost}"
    if not driver.alive:
        return "the engine thread stopped"
    running = driver.step_running_s()
    if stall_s > 0 and running > stall_s:
        return (
            f"the engine's step has run {running:.0f}s, past --engine-stall-s {stall_s:g}s: "
            "the engine is hung"
        )
    return None


class WorkerService:
    def __init__(
        self,
        ctx: ServiceContext,
        engine_options: Mapping[str, Any],
        engine_stall_s: float = DEFAULT_ENGINE_STALL_S,
    ) -> None:
        self.ctx = ctx
        self.engine_stall_s = engine_stall_s
        self.subjects = ctx.subjects
        self.worker_id = ctx.settings.instance_id
        self.engine_options = engine_options
        self.status = protocol.WorkerStatus.STARTING
        self.epoch = time.time_ns()
        self.capacity = protocol.WorkerCapacity(
            max_running_requests=0, max_total_num_tokens=0, max_context_len=0
        )
        self.model_name = ""
        # (step, outputs, resent): one StepOutputBatch each
        self.outbox: asyncio.Queue[
            tuple[int, list[protocol.StepOutput], list[protocol.StepOutput]]
        ] = asyncio.Queue()
        self.kv_outbox: asyncio.Queue[list[protocol.KvEvent]] = asyncio.Queue()
        self.kv_event_seq = -1  # the last KvEventBatch numbered (published or not)
        self.driver: Any = None
        self.telemetry = WorkerTelemetry(
            WorkerMetrics(ctx.metrics, self.worker_id), get_tracer(SERVICE)
        )
        self._last_tokens = 0
        self._last_stats = time.monotonic()
        # Constrained requests waiting for their compiled grammar (rid -> task); they
        # reach the engine only once it is loaded.
        self.grammars: Any = None
        self._grammar_waits: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        started = time.monotonic()
        self.ctx.spawn(self._heartbeats(), "heartbeats")  # "starting" while the model loads
        from radixserve.engine.engine import Engine
        from radixserve.worker.driver import EngineDriver

        engine = await asyncio.to_thread(Engine, **self.engine_options)
        from radixserve.worker.grammars import GrammarLoader

        await asyncio.to_thread(engine.grammars.warm_up)  # before the engine thread runs
        self.grammars = GrammarLoader(engine.grammars, self._fetch_grammar)
        loop = asyncio.get_running_loop()
        kv_block_size = engine.enable_kv_events()  # before any request: the tree is empty
        self.driver = EngineDriver(
            engine,
            on_step=lambda step, outs: self._from_thread(
                loop, self.outbox.put_nowait, (step, outs, [])
            ),
            on_resent=lambda step, resent: self._from_thread(
                loop, self.outbox.put_nowait, (step, [], resent)
            ),
            on_reject=lambda error, gateway: self._from_thread(
                loop, self._spawn_reject, error, gateway
            ),
            telemetry=self.telemetry,
            on_kv_events=lambda events: self._from_thread(loop, self.kv_outbox.put_nowait, events),
        )
        config = engine.config
        self.telemetry.metrics.set_cache_config(config.page_size, engine.runner.kv_pool.num_pages)
        self.capacity = protocol.WorkerCapacity(
            max_running_requests=engine.runner.max_running_requests,
            max_total_num_tokens=engine.runner.kv_pool.size,
            max_context_len=engine.context_len,
            page_size=config.page_size,
            kv_block_size=kv_block_size,
        )
        self.model_name = str(engine.runner.model_path)
        self.driver.start()
        self.ctx.spawn(self._publish_steps(), "publish-steps")
        self.ctx.spawn(self._publish_kv_events(), "publish-kv-events")
        self.ctx.spawn(self._stats(), "stats")
        self.ctx.spawn(self._watch_engine(), "watch-engine")
        await self.ctx.bus.subscribe(self.subjects.worker_all(self.worker_id), self._on_message)
        await self.ctx.bus.subscribe(self.subjects.detok_resync, self._on_resync)
        metrics = self.telemetry.metrics
        metrics.start_duration.labels(**metrics.label()).set(time.monotonic() - started)
        self.status = protocol.WorkerStatus.READY
        await self._heartbeat()
        self.ctx.on_drain(self._drain)
        log.info(
            "worker %s ready: model %s, KV pool %d tokens",
            self.worker_id,
            self.model_name,
            self.capacity.max_total_num_tokens,
        )

    # -- messages addressed to this worker ------------------------------------------------
    async def _on_message(self, msg: BusMsg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind == "run":
            if self.status is not protocol.WorkerStatus.READY:
                # Sent before the scheduler heard this worker is draining: refused in the
                # acknowledgement, so the scheduler re-routes it to another worker.
                log.info("run refused: draining")
                await self.ctx.bus.acknowledge(msg, {protocol.RUN_REFUSED_HEADER: "draining"})
                return
            await self.ctx.bus.acknowledge(msg)  # received: the scheduler stops waiting
            routed = decode_or_drop(msg, protocol.RoutedRequest, log, level=logging.ERROR)
            if routed is None:
                return
            log.debug("run", extra={"rid": routed.rid})
            self.telemetry.received(routed)  # in the scheduler's trace context
            if routed.request.grammar_key is not None:
                with self.telemetry.active(routed.rid):  # the grammar fetch: a child span
                    task = self.ctx.spawn(self._submit_constrained(routed), f"grammar-{routed.rid}")
                self._grammar_waits[routed.rid] = task
                task.add_done_callback(functools.partial(self._grammar_wait_done, routed))
            else:
                self.driver.submit(routed)
        elif kind == "abort":
            abort = decode_or_drop(msg, protocol.AbortRequest, log)
            if abort is None:
                return
            log.info("abort: %s", abort.reason or "requested", extra={"rid": abort.rid})
            waiting = self._grammar_waits.get(abort.rid)
            if waiting is not None:
                waiting.cancel()  # it answers the abort itself
            else:
                self.driver.abort(abort.rid)
        elif kind == "flush_cache":
            # In a task of its own: runs and aborts behind it are not held up.
            request = decode_or_drop(msg, protocol.FlushCacheRequest, log)
            if request is None:
                return
            self.ctx.spawn(self._flush_cache(msg, request), f"flush-{request.rid}")
        elif kind == "kv_snapshot":
            snapshot = decode_or_drop(msg, protocol.KvSnapshotRequest, log)
            if snapshot is None:
                return
            log.info("KV snapshot asked for: %s", snapshot.reason or "no reason given")
            self.driver.kv_snapshot()  # answered on kv_events, in sequence

    async def _on_resync(self, msg: BusMsg) -> None:
        """A detokenizer lost these requests' state: their history goes out with the next
        batch (only from the worker holding them)."""
        resync = decode_or_drop(msg, protocol.DetokResync, log)
        if resync is not None:
            log.info("detokenizer resync: %s", len(resync.rids) or "every request")
            self.driver.resync(tuple(resync.rids))

    async def _flush_cache(self, msg: BusMsg, request: protocol.FlushCacheRequest) -> None:
        try:
            ok = await asyncio.wait_for(
                asyncio.wrap_future(self.driver.flush_cache()), FLUSH_TIMEOUT_S
            )
            message = "" if ok else "requests are running; the cache was not flushed"
        except TimeoutError:
            ok, message = False, f"the engine did not answer within {FLUSH_TIMEOUT_S:g} s"
        reply = protocol.FlushCacheReply(
            rid=request.rid, ok=ok, worker_id=self.worker_id, message=message
        )
        if msg.reply:
            try:
                await self.ctx.bus.respond(msg, protocol.encode(reply))
            except BusError as exc:  # the asker times out on its own
                log.warning("flush_cache reply not sent: %r", exc, extra={"rid": request.rid})

    def _grammar_wait_done(self, routed: protocol.RoutedRequest, task: asyncio.Task[Any]) -> None:
        """A grammar wait cancelled before it ever ran (an abort right behind its run
        message) ran none of its own handlers: answer the abort here."""
        if task.cancelled() and self._grammar_waits.pop(routed.rid, None) is not None:
            self.telemetry.forget(routed.rid)
            self.driver.abort_unsubmitted(routed)

    # -- structured outputs: the grammar first, then the engine ---------------------------
    async def _submit_constrained(self, routed: protocol.RoutedRequest) -> None:
        from radixserve.worker.grammars import GrammarLoadError

        request = routed.request
        try:
            grammar = await self.grammars.load(request)
        except GrammarLoadError as exc:
            self.telemetry.forget(request.rid)
            await self._reject(exc.to_request_error(request), request.gateway_id)
            return
        except asyncio.CancelledError:  # an abort (or the drain): answered like the engine's
            self.telemetry.forget(request.rid)
            self.driver.abort_unsubmitted(routed)
            raise
        finally:
            self._grammar_waits.pop(request.rid, None)
        self.driver.submit(routed, grammar)

    async def _fetch_grammar(
        self, request: protocol.GrammarFetchRequest
    ) -> protocol.GrammarFetchReply | None:
        """The grammar service's answer, or None without one (the loader then compiles)."""
        try:
            with self.ctx.metrics.time_nats("grammar.fetch"):
                raw = await self.ctx.bus.request(
                    self.subjects.grammar_fetch,
                    protocol.encode(request),
                    timeout_s=GRAMMAR_FETCH_TIMEOUT_S,
                )
            return protocol.decode(raw.data, protocol.GrammarFetchReply)
        except (BusError, protocol.ProtocolError) as exc:  # timeout, no responders, closed
            log.warning("grammar fetch failed: %r", exc, extra={"rid": request.rid})
            return None

    @staticmethod
    def _from_thread(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
        """Run `callback(*args)` on the event loop (called from the engine thread)."""
        if not loop.is_closed():
            loop.call_soon_threadsafe(callback, *args)

    def _spawn_reject(self, error: protocol.RequestError, gateway_id: str) -> None:
        self.telemetry.forget(error.rid)
        self.ctx.spawn(self._reject(error, gateway_id), f"reject-{error.rid}")

    async def _reject(self, error: protocol.RequestError, gateway_id: str) -> None:
        log.info("rejected: %s", error.message, extra={"rid": error.rid})
        try:
            await self.ctx.bus.publish(
                self.subjects.gateway_errors(gateway_id), protocol.encode(error)
            )
        except BusError as exc:  # the gateway's own deadline answers the client
            log.error("rejection not sent: %r", exc, extra={"rid": error.rid})

    # -- background tasks -------------------------------------------------------------------
    async def _publish_steps(self) -> None:
        while True:
            step, outputs, resent = await self.outbox.get()
            batch = protocol.StepOutputBatch(
                worker_id=self.worker_id, step=step, outputs=outputs, resent=resent
            )
            # Each request's own span context for the detokenizer (the batch mixes requests).
            headers = self.telemetry.batch_headers(outputs)
            try:
                await self.ctx.bus.publish(
                    self.subjects.detok, protocol.encode(batch), headers=headers or None
                )
            except BusError as exc:
                # NATS unreachable past its reconnect buffer, say: these outputs are lost
                # (the detokenizer logs the gap), the worker and its other requests are not.
                log.error("step %d's %d outputs not published: %r", step, len(outputs), exc)

    async def _publish_kv_events(self) -> None:
        while True:
            events = await self.kv_outbox.get()
            for group in protocol.split_events(events):
                self.kv_event_seq += 1
                batch = protocol.KvEventBatch(
                    worker_id=self.worker_id,
                    epoch=self.epoch,
                    seq=self.kv_event_seq,
                    events=group,
                    time=time.time(),
                )
                try:
                    await self.ctx.bus.publish(
                        self.subjects.kv_events(self.worker_id), protocol.encode(batch)
                    )
                except BusError as exc:
                    # The scheduler sees the gap in `seq` and asks for a snapshot.
                    log.warning("KV event batch %d not published: %r", batch.seq, exc)

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            failure = engine_failure(self.driver, self.engine_stall_s)
            if failure is None or (self.ctx.stopping.is_set() and self.driver.error is None):
                continue  # (a stop ends the engine thread: not a failure)
            if self.driver.alive:
                log.error("%s; the engine thread is at:\n%s", failure, self.driver.thread_stack())
            raise RuntimeError(failure)

    async def _heartbeats(self) -> None:
        while True:
            await self._heartbeat()
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _heartbeat(self) -> None:
        beat = protocol.Heartbeat(
            worker_id=self.worker_id,
            time=time.time(),
            status=self.status,
            capacity=self.capacity,
            epoch=self.epoch,
            kv_event_seq=self.kv_event_seq,
            model=self.model_name,
            requests=[] if self.driver is None else self.driver.held_requests(),
            requests_listed=self.driver is not None,
        )
        if self.ctx.bus.is_connected:
            await self.ctx.bus.publish(
                self.subjects.heartbeat(self.worker_id), protocol.encode(beat)
            )

    async def _stats(self) -> None:
        while True:
            await self._publish_stats()
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _publish_stats(self) -> None:
        load = self.driver.load
        now = time.monotonic()
        tokens = self.driver.generated_tokens
        throughput = (tokens - self._last_tokens) / max(now - self._last_stats, 1e-6)
        self._last_tokens, self._last_stats = tokens, now
        kv = load.kv
        stats = protocol.WorkerStats(
            worker_id=self.worker_id,
            time=time.time(),
            num_running_reqs=load.num_running_reqs,
            num_queue_reqs=load.num_queue_reqs,
            free_kv_tokens=kv.free_tokens,
            evictable_kv_tokens=kv.evictable_tokens,
            total_kv_tokens=kv.pool_size,
            token_usage=kv.used_tokens / kv.pool_size if kv.pool_size else 0.0,
            cache_hit_rate=self.telemetry.observe_load(load),
            gen_throughput=throughput,
        )
        if self.ctx.bus.is_connected:
            await self.ctx.bus.publish(self.subjects.stats(self.worker_id), protocol.encode(stats))

    # -- drain --------------------------------------------------------------------------------
    async def _drain(self) -> None:
        """Within the service's drain budget (which cancels this past it): running
        requests get 60% of it to finish, then are aborted; their final outputs and the
        outbox get until 85%; the engine thread stops within the rest."""
        started, budget = time.monotonic(), self.ctx.settings.drain_timeout_s

        def until(share: float) -> float:
            return started + budget * share

        self.status = protocol.WorkerStatus.DRAINING
        await self._heartbeat()
        for waiting in list(self._grammar_waits.values()):
            waiting.cancel()  # not started yet: answered as aborted
        while self.driver.num_tracked and time.monotonic() < until(0.6):
            await asyncio.sleep(0.05)
        # What is left goes on elsewhere: stopped here without a finish, its outputs so far
        # published first, then the "stopping" heartbeat has the scheduler re-route it.
        handed = await asyncio.wrap_future(self.driver.hand_off())
        if handed:
            log.info("handing %d unfinished requests to other workers", len(handed))
        while not self.outbox.empty() and time.monotonic() < until(0.85):
            await asyncio.sleep(0.01)
        self.status = protocol.WorkerStatus.STOPPING
        await self._heartbeat()
        await asyncio.to_thread(self.driver.stop, max(until(0.95) - time.monotonic(), 0.1))
        self.telemetry.end_all()
