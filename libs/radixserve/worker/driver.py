"""The engine in its own thread, driven through the step API.

The asyncio side (the worker service) never waits on the engine: `submit`, `abort`
and `flush_cache` put a command in a thread-safe inbox and return; the engine thread
applies the commands between steps, runs `engine.step()`, and hands one list of
`StepOutput`s per step to `on_step` (which the service forwards to its event loop).
`resync` has it hand a detokenizer that lost its state the whole output of the asked
requests (`on_resent`, between steps, numbered in the same sequence as the steps).
With `on_kv_events`, the prefix cache's changes go the same way after each step (and a
snapshot of the whole cache when `kv_snapshot` asks), for the scheduler's mirror.
A snapshot of the engine's load is refreshed after every step for stats, and the
start of the step in progress is kept, so the service can tell a hung engine
(`step_running_s`) and log where it hangs (`thread_stack`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve import protocol
from radixserve.engine.engine import Engine, EngineLoad
from radixserve.worker.convert import OutputBuilder, submit_request
from radixserve.worker.metrics import WorkerTelemetry

log = logging.getLogger(__name__)

StepCallback = Callable[[int, list[protocol.StepOutput]], None]  # (step number, outputs)
RejectCallback = Callable[[protocol.RequestError, str], None]  # (error, gateway id)
KvEventsCallback = Callable[[list[protocol.KvEvent]], None]  # in the cache's order

LOAD_REFRESH_S = 0.1  # stats go out every second; a fresher load is never read
RESENT_BATCH_BYTES = 512 * 1024  # a history batch's outputs, under NATS's 1 MiB default
_PARAM_RE = re.compile(r"sampling parameter '(\w+)'")


@dataclass(frozen=True)
class _Submit:
    routed: protocol.RoutedRequest
    grammar: Any = None  # the request's compiled grammar (xgrammar), loaded off the loop


@dataclass(frozen=True)
class _Gone:
    """A request that never reached the engine (aborted while its grammar was fetched)."""

    routed: protocol.RoutedRequest


@dataclass(frozen=True)
class _Abort:
    rid: str


@dataclass(frozen=True)
class _Resync:
    rids: tuple[str, ...]  # empty: every request with output


@dataclass(frozen=True)
class _Flush:
    done: concurrent.futures.Future[bool]


@dataclass(frozen=True)
class _Snapshot:
    """Send the whole cache as KV events (it replaces the events not sent yet)."""


@dataclass(frozen=True)
class _HandOff:
    """Stop every request, publishing nothing more for them (see `hand_off`)."""

    done: concurrent.futures.Future[list[str]]


class EngineDriver:
    def __init__(
        self,
        engine: Engine,
        on_step: StepCallback,
        on_reject: RejectCallback,
        idle_wait_s: float = 0.05,
        telemetry: WorkerTelemetry | None = None,
        on_kv_events: KvEventsCallback | None = None,
        on_resent: StepCallback | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_resent = on_resent
        self.on_reject = on_reject
        self.on_kv_events = on_kv_events
        self.idle_wait_s = idle_wait_s
        # Step time, batch size and the per-request counters/spans, measured here in the
        # engine thread (prometheus_client and OTel spans are thread-safe).
        self.telemetry = telemetry
        self.builder = OutputBuilder()
        self.error: BaseException | None = None
        self.steps = 0
        self.load: EngineLoad = engine.load()
        self._load_at = time.monotonic()
        self.generated_tokens = 0  # for throughput in stats
        self._inbox: queue.SimpleQueue[
            _Submit | _Gone | _Abort | _Flush | _Snapshot | _HandOff | _Resync
        ] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._step_started: float | None = None  # monotonic, while a step runs

    # -- called from the asyncio side (any thread) ----------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, routed: protocol.RoutedRequest, grammar: Any = None) -> None:
        """`grammar`: the compiled grammar of a request with a `grammar_key` (see
        `worker.grammars`); without it the engine would compile it on its own thread."""
        self._inbox.put(_Submit(routed, grammar))

    def abort_unsubmitted(self, routed: protocol.RoutedRequest) -> None:
        """Answer an abort of a request the engine never got: its final outputs (finish
        kind `abort`) go out in step order like every other output."""
        self._inbox.put(_Gone(routed))

    def abort(self, rid: str) -> None:
        self._inbox.put(_Abort(rid))

    def resync(self, rids: tuple[str, ...] = ()) -> None:
        """Send the whole output so far of `rids` (every request when empty) that run here
        or finished lately, through `on_resent`; nothing when none is here."""
        self._inbox.put(_Resync(rids))

    def hand_off(self) -> concurrent.futures.Future[list[str]]:
        """Stop every request here without a word on the outputs (no abort finish): the
        scheduler re-routes them with the tokens they had sent. The future: their rids,
        once stopped (every output before it is published already)."""
        done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self._inbox.put(_HandOff(done))
        return done

    def flush_cache(self) -> concurrent.futures.Future[bool]:
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._inbox.put(_Flush(done))
        return done

    def kv_snapshot(self) -> None:
        """Have the engine thread send its whole cache through `on_kv_events` (between
        steps, so it is in order with the events before and after it)."""
        self._inbox.put(_Snapshot())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def held_requests(self) -> list[protocol.HeldRequest]:
        """What the engine runs for the gateways (read off the engine thread: a copy)."""
        gateways, unfinished = dict(self.builder.gateways), dict(self.builder.unfinished)
        return [
            protocol.HeldRequest(rid=rid, gateway_id=gateway, choices=unfinished.get(rid, 1))
            for rid, gateway in gateways.items()
        ]

    @property
    def num_tracked(self) -> int:
        return len(self.builder)

    def step_running_s(self) -> float:
        """How long the engine's current step has run (0 between steps): a step that runs
        on and on is a hung engine (a stuck device, a deadlock), not a busy one."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def thread_stack(self) -> str:
        """Where the engine thread is now, as a traceback (for the log of a stall)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_work()
                self._apply_commands(wait_s=0.0 if busy else self.idle_wait_s)
                if self.engine.has_work():
                    self._step()
                self._send_kv_events(self.engine.drain_kv_events())
                now = time.monotonic()
                if now - self._load_at >= LOAD_REFRESH_S:  # a tree walk: not every step
                    self.load = self.engine.load()
                    self._load_at = now
        except BaseException as exc:  # reported by the service, which then exits non-zero
            log.exception("the engine thread failed")
            self.error = exc

    def _apply_commands(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                timeout = max(deadline - time.monotonic(), 0.0)
                command = (
                    self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
                )
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                self._submit(command.routed, command.grammar)
            elif isinstance(command, _Gone):
                aborted = self._aborted_outputs(command.routed)
                if self.telemetry is not None:  # counted like the engine's own aborts
                    self.telemetry.observe_outputs(time.perf_counter(), aborted)
                self._publish(aborted)
            elif isinstance(command, _Abort):
                self.engine.abort(command.rid)
            elif isinstance(command, _Snapshot):
                self._send_kv_events(self.engine.kv_snapshot())
            elif isinstance(command, _Resync):
                if self.on_resent is not None:
                    for resent in history_batches(self.builder.history(command.rids)):
                        self.steps += 1
                        self.on_resent(self.steps, resent)
            elif isinstance(command, _HandOff):
                rids = list(self.builder.gateways)
                for rid in rids:
                    self.engine.abort(rid)
                    self.builder.forget(rid)  # its abort's outputs are not published
                command.done.set_result(rids)
            elif command.done.set_running_or_notify_cancel():  # not given up on meanwhile
                command.done.set_result(self.engine.flush_cache())
            deadline = 0.0  # after the first command, only drain what is already there

    def _submit(self, routed: protocol.RoutedRequest, grammar: Any = None) -> None:
        request = routed.request
        try:
            submit_request(
                self.engine, request, grammar, routed.output_prefix, routed.choice_prefixes
            )
        except ValueError as exc:
            match = _PARAM_RE.search(str(exc))
            error = protocol.RequestError(
                rid=request.rid,
                code="invalid_request_error",
                message=str(exc),
                http_status=400,
                param=match.group(1) if match else None,
                service="worker",
            )
            if self.telemetry is not None:
                self.telemetry.rejected(request.rid, error.code, error.message)
            self.on_reject(error, request.gateway_id)
            return
        running = resumed_choices(routed)
        self.builder.track(
            request.rid, request.gateway_id, len(running), resumable=request.resumable
        )
        resumed = sum(running.values())
        if resumed:
            log.info(
                "resumed after %d generated tokens (attempt %d)",
                resumed,
                routed.attempt,
                extra={"rid": request.rid},
            )
            if self.telemetry is not None:
                self.telemetry.resumed()

    def _step(self) -> None:
        outputs = []
        started = time.perf_counter()
        self._step_started = time.monotonic()
        try:
            choices = self.engine.step()
        finally:
            self._step_started = None
        seconds = time.perf_counter() - started
        for choice in choices:
            self.generated_tokens += len(choice.new_token_ids)
            message = self.builder.build(choice)
            if message is not None:
                outputs.append(message)
        if self.telemetry is not None:
            batch_size = sum(1 for choice in choices if choice.new_token_ids)
            self.telemetry.observe_step(started, seconds, batch_size, outputs)
        self._publish(outputs)

    def _send_kv_events(self, events: list[protocol.KvEvent]) -> None:
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def _publish(self, outputs: list[protocol.StepOutput]) -> None:
        if outputs:
            # Numbered per published batch, so the detokenizer can tell a lost one.
            self.steps += 1
            self.on_step(self.steps, outputs)

    @staticmethod
    def _aborted_outputs(routed: protocol.RoutedRequest) -> list[protocol.StepOutput]:
        request = routed.request
        wire = request.sampling
        detok = protocol.DetokParams(
            skip_special_tokens=wire.skip_special_tokens,
            spaces_between_special_tokens=wire.spaces_between_special_tokens,
            stop=list(wire.stop),
            no_stop_trim=wire.no_stop_trim,
            resumable=request.resumable,
        )
        return [
            protocol.StepOutput(
                rid=request.rid,
                gateway_id=request.gateway_id,
                new_token_ids=protocol.pack_tokens([]),
                index=index,
                finish_reason=protocol.FinishReason(kind="abort", message="aborted"),
                prompt_tokens=request.prompt_tokens,
                # A resumed choice's stream goes on from the tokens it had.
                completion_tokens=resumed,
                detok=detok,
            )
            for index, resumed in resumed_choices(routed).items()
        ]


def history_batches(
    outputs: list[protocol.StepOutput], max_bytes: int = RESENT_BATCH_BYTES
) -> list[list[protocol.StepOutput]]:
    """`outputs` in batches of at most `max_bytes` encoded (one larger output alone):
    a long history of many requests must not pass the bus's payload limit."""
    batches: list[list[protocol.StepOutput]] = []
    size = max_bytes
    for out in outputs:
        cost = len(protocol.encode(out))
        if size + cost > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(out)
        size += cost
    return batches


def resumed_choices(routed: protocol.RoutedRequest) -> dict[int, int]:
    """Each choice index this worker runs -> how many output tokens it already has (0 for
    a new request); a re-routed request's finished choices are not run here."""
    if routed.choice_prefixes is not None:
        return {
            index: protocol.num_tokens(prefix)
            for index, prefix in enumerate(routed.choice_prefixes)
            if prefix is not None
        }
    prefix = routed.output_prefix
    resumed = 0 if prefix is None else protocol.num_tokens(prefix)
    return {index: resumed if index == 0 else 0 for index in range(routed.request.sampling.n)}
