"""One HTTP generation request on the bus: publish, wait for its deltas, abort, account.

    run = Inflight(state, plan)             # registers its rids with the hub
    await run.submit()                      # record + SubmitRequest(s) on {p}.tokenize, acked
    while not run.assembly.done:
        update = await run.next_update()    # ApiError (bus error, 504), ClientDisconnected
        more = run.ready_update()           # the next one if already there, else None
    run.close()                             # metrics, record, hub; aborts what still runs

`close` is synchronous and idempotent, so a streaming response can call it from a
cancelled task (the client hung up); whatever is unfinished then gets an
`AbortRequest` through the `AbortSender`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from opentelemetry.context import Context

from radixserve.api import ApiError, Assembly, ChoiceUpdate, GenerationPlan
from radixserve.auth import ApiKey
from radixserve.bus import BusError, BusNoResponders, BusPayloadTooLarge, BusTimeout
from radixserve.protocol import RequestError, TextDelta, encode, num_tokens
from radixserve.services.gateway.hub import (
    ClientGone,
    DeadlinePassed,
    HubFailure,
    Mailbox,
    RequestLost,
)
from radixserve.services.gateway.resume import event_id_line, record_fields
from radixserve.services.gateway.state import GatewayState
from radixserve.store import FieldValue
from radixserve.telemetry.gateway_trace import RequestTrace
from radixserve.telemetry.latency import TokenTimes

log = logging.getLogger(__name__)

# nginx's "client closed request": only ever seen in metrics and records.
CLIENT_CLOSED_STATUS = 499


class ClientDisconnected(Exception):
    """The client hung up before the answer was complete."""


class Inflight:
    def __init__(
        self,
        state: GatewayState,
        plan: GenerationPlan,
        trace_parent: Context | None = None,
        api_key: ApiKey | None = None,
        *,
        resumable: bool = False,
    ) -> None:
        self.state = state
        self.plan = plan
        # Its deltas are kept (gateway/resume.py): a client that leaves may come back.
        self.resumable = resumable
        self.created = int(time.time())  # the answer's `created`, a resumed one's too
        self.counts = dict.fromkeys(plan.rids, 0)  # deltas taken, per rid (the SSE ids)
        self.replaying = False  # an original run sends every update
        self._detached: asyncio.Task[None] | None = None
        self.api_key = api_key  # the caller's, with auth on: its tokens are charged to it
        self.assembly = Assembly(plan)
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.token_times = TokenTimes(self.started)
        self.trace = RequestTrace(plan, trace_parent)  # the request's root span
        self._mailbox: Mailbox = state.hub.register(plan.rids)
        # One timer for the whole request (not one per wait): DeadlinePassed at its deadline.
        self._deadline = asyncio.get_running_loop().call_later(
            state.settings.request_timeout_s, self._mailbox.put, DeadlinePassed()
        )
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        # Rids another service already failed (RequestError): nothing left to abort there.
        self._failed_rids: set[str] = set()
        # When the last event was taken from the queue; None until the tokenizer took the
        # request (before that, nothing downstream can know of it).
        self.heard_at: float | None = None
        state.add_inflight(self)

    @property
    def rid(self) -> str:
        return self.plan.response_id

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- sending --------------------------------------------------------------------------
    async def submit(self) -> None:
        state, plan = self.state, self.plan
        state.records.put(
            self.rid,
            {
                "state": "received",
                "endpoint": plan.endpoint,
                "model": plan.model,
                "stream": int(plan.stream),
                "n": plan.n,
                "num_prompts": len(plan.submits),
                "received_at": time.time(),
                **({} if self.api_key is None else {"api_key": self.api_key.name}),
                **(record_fields(plan, self.created) if self.resumable else {}),
            },
        )
        # Each prompt goes out as a request the tokenizer acknowledges on receipt: with no
        # tokenizer running, or a message lost on the way, the client hears 503 in
        # seconds instead of waiting out request_timeout_s.
        ack_timeout_s = state.settings.submit_ack_timeout_s
        try:
            with self.trace.active():  # the tokenizer's span continues this trace
                await asyncio.gather(
                    *(
                        state.bus.request(
                            state.subjects.tokenize, encode(submit), timeout_s=ack_timeout_s
                        )
                        for submit in plan.submits
                    )
                )
        except BusPayloadTooLarge as exc:
            limit = state.bus.nats_client.max_payload
            raise ApiError.too_large(
                f"the request is larger than the message bus carries ({limit} bytes); "
                "send a shorter prompt"
            ) from exc
        except BusNoResponders as exc:
            raise ApiError.unavailable("no tokenizer is running", "no_tokenizer") from exc
        except BusTimeout as exc:
            raise ApiError.unavailable(
                f"the tokenizer did not acknowledge the request within {ack_timeout_s:g} s",
                "tokenizer_unresponsive",
            ) from exc
        except BusError as exc:
            raise ApiError.unavailable(f"cannot reach the tokenizer: {exc}", "no_bus") from exc
        state.records.update(self.rid, {"state": "queued", "queued_at": time.time()})
        self.heard_at = time.monotonic()

    # -- receiving ------------------------------------------------------------------------
    async def next_update(self) -> ChoiceUpdate:
        """The next delta that changed a choice, waiting for it if none is there. Raises
        ApiError for a bus error or the deadline (504), ClientDisconnected when the
        disconnect watcher saw the client go."""
        while (update := self.ready_update()) is None:
            await self._mailbox.wait()
        return update

    def ready_update(self) -> ChoiceUpdate | None:
        """As `next_update`, without waiting: None when no such delta is there yet."""
        while (event := self._mailbox.take()) is not None:
            now = self.heard_at = time.monotonic()
            if not isinstance(event, TextDelta):
                raise self._failure(event)
            if event.rid in self.counts:  # as the output log numbers it, if it does
                seq = event.seq
                self.counts[event.rid] = self.counts[event.rid] + 1 if seq is None else seq + 1
            if event.worker_id:
                self.state.records.update(self.rid, {"worker": event.worker_id})
            update = self.assembly.apply(event)
            if update is not None:
                self._tokens_arrived(event, now)
                return update
        return None

    def _failure(self, event: HubFailure) -> Exception:
        """What an event other than a delta ends the request with."""
        if isinstance(event, RequestError):
            self._failed_rids.add(event.rid)
            return self.plan.client_error(ApiError.from_request_error(event))
        if isinstance(event, ClientGone):
            return ClientDisconnected()
        if isinstance(event, RequestLost):
            return ApiError.unavailable(
                "the request was lost on its way back (it is no longer running, but "
                "its end never reached the gateway); retry",
                "request_lost",
            )
        return ApiError.timeout(self.state.settings.request_timeout_s)

    async def run_to_end(self) -> None:
        while not self.assembly.done:
            await self.next_update()

    def _tokens_arrived(self, delta: TextDelta, now: float) -> None:
        count = num_tokens(delta.token_ids)
        if not (count or delta.text):
            return
        ttft_s, per_token_s = self.token_times.on_tokens((delta.rid, delta.index), count, now)
        if ttft_s is not None:
            self._first_token(now)
        if per_token_s is not None:
            self.state.metrics.observe_inter_token(per_token_s, count)

    def _first_token(self, now: float) -> None:
        self.first_token_at = now
        self.state.metrics.observe_first_token(self.first_token_at - self.started)
        self.trace.first_token()
        self.state.records.update(self.rid, {"state": "running", "first_token_at": time.time()})

    def event_id(self) -> bytes:
        """The SSE id of the events of the update just taken."""
        return event_id_line(self.plan.response_id, self.counts, self.plan.rids)

    # -- the lost-request check ---------------------------------------------------------------
    def silent_since(self) -> float | None:
        """Since when nothing came for this request: None while an event waits in its
        mailbox, before the tokenizer took it, or once it is closed."""
        if self._closed or self.heard_at is None or not self._mailbox.empty():
            return None
        return self.heard_at

    def report_lost(self) -> None:
        """Fail the request as lost (503); `close` then aborts its unfinished rids, in
        case they still run somewhere."""
        self._mailbox.put(RequestLost())

    # -- the client -------------------------------------------------------------------------
    def watch_disconnect(self, receive: Any) -> None:
        """Turn an ASGI `http.disconnect` into a `ClientGone` event (body already read)."""

        async def watch() -> None:
            while True:
                message = await receive()
                if message.get("type") == "http.disconnect":
                    self._mailbox.put(ClientGone())
                    return

        self._watcher = asyncio.create_task(watch(), name=f"disconnect-{self.rid}")
        self._watcher.add_done_callback(self._watcher_done)

    def _watcher_done(self, task: asyncio.Task[None]) -> None:
        """A watcher that failed (not cancelled) leaves the request to its deadline: say so."""
        if not task.cancelled() and task.exception() is not None:
            log.error("disconnect watcher failed: %r", task.exception(), extra={"rid": self.rid})

    async def stop_watching(self) -> None:
        """Before a streaming response takes over `receive` (Starlette watches it then)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    # -- a client that left -------------------------------------------------------------------
    def client_left(self) -> None:
        """The client hung up: a resumable request runs on, detached, for a client that
        comes back (to any gateway); any other is closed (aborted) now."""
        if self._closed or self._detached is not None:
            return
        if not self.resumable:
            self.close(client_gone=True)
            return
        self._detached = asyncio.get_running_loop().create_task(
            self._run_detached(), name=f"detached-{self.rid}"
        )

    async def _run_detached(self) -> None:
        """To the end, unless no client resumed within the grace (then aborted as gone)."""
        grace_s = self.state.settings.resume_grace_s
        left_at = time.time()
        try:
            try:
                await asyncio.wait_for(self.run_to_end(), grace_s)
            except TimeoutError:
                if not await self._resumed_since(left_at):
                    self.close(client_gone=True)
                    return
                await self.run_to_end()
            self.close()
        except ApiError as exc:
            self.close(exc)
        except Exception as exc:  # a bug: still account for the request, and abort it
            log.error("detached run failed: %r", exc, extra={"rid": self.rid}, exc_info=exc)
            self.close(client_gone=True)

    async def _resumed_since(self, left_at: float) -> bool:
        try:
            record = await self.state.records.get(self.rid)
        except Exception as exc:  # no store: no one can resume it either
            log.warning("reading the request record failed: %r", exc, extra={"rid": self.rid})
            return False
        resumed_at = None if record is None else record.get("resumed_at")
        return resumed_at is not None and float(resumed_at) >= left_at

    # -- the end --------------------------------------------------------------------------
    def close(self, error: ApiError | None = None, *, client_gone: bool = False) -> None:
        """Account for the request once: abort what still runs, metrics, record, hub."""
        if self._closed:
            return
        self._closed = True
        state = self.state
        self._deadline.cancel()
        if self._detached is not None and self._detached is not asyncio.current_task():
            self._detached.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        state.hub.unregister(self.plan.rids)
        state.remove_inflight(self)
        reason = (
            "client_disconnected" if client_gone else ((error.code or error.type) if error else "")
        )
        for rid in self.assembly.unfinished_rids():
            if rid not in self._failed_rids:
                state.aborts.send(rid, reason or "unfinished")
        status = CLIENT_CLOSED_STATUS if client_gone else (error.status if error else 200)
        usage = self.assembly.usage()
        if self.api_key is not None and state.guard is not None:
            state.guard.limiter.charge_soon(
                self.api_key, usage.prompt_tokens + usage.completion_tokens
            )
        ok = error is None and not client_gone
        e2e_s = self.elapsed()
        finish = [c.finish.kind for c in self.assembly.choices if c.finish is not None]
        state.metrics.observe_request(
            status=status,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            e2e_s=e2e_s if ok else None,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started,
            max_choice_tokens=max((c.completion_tokens for c in self.assembly.choices), default=0),
            finish_reasons=finish,
            error_type=None if error is None or client_gone else error.type,
            error_code=None if error is None or client_gone else error.code,
        )
        self.trace.finish(
            status=status,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            finish_reasons=finish,
            error_type="client_closed" if client_gone else (error.type if error else None),
            error_message=reason,
            outputs=[c.text for c in self.assembly.choices],
        )
        fields: dict[str, FieldValue] = {
            "state": "finished" if ok else "failed",
            "finished_at": time.time(),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        }
        if finish:
            fields["finish_reason"] = ",".join(dict.fromkeys(finish))
        if not ok:
            fields["http_status"] = status
            fields["error_code"] = reason or "error"
        state.records.update(self.rid, fields)
        log.info(
            "%s %s in %.3fs: %d prompt + %d completion tokens",
            self.plan.endpoint,
            status,
            e2e_s,
            usage.prompt_tokens,
            usage.completion_tokens,
            extra={"rid": self.rid},
        )
