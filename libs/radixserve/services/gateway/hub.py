"""Route the bus messages addressed to this gateway to the HTTP handler waiting on each rid.

    hub = Hub(subjects, gateway_id)
    await bus.subscribe(subjects.gateway_all(gateway_id), hub.on_message)
    mailbox = hub.register(plan.rids)      # before publishing the SubmitRequests
    await mailbox.wait()                   # until an event is there
    event = mailbox.take()                 # TextDelta | RequestError | ClientGone | ...
    hub.unregister(plan.rids)

Delivery never blocks: each waiting request has an unbounded mailbox (its producer is
the bus, whose rate the detokenizer's batching already bounds). Messages for a rid
nobody waits on (a request already answered or aborted) are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.bus import BusMsg
from radixserve.protocol import (
    ProtocolError,
    RequestError,
    Subjects,
    TextDelta,
    TextDeltaBatch,
    decode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientGone:
    """Put on a request's queue by its disconnect watcher: the client hung up."""


@dataclass(frozen=True)
class RequestLost:
    """Put on a request's queue by the lost-request check (gateway/lost.py): the
    scheduler saw its rids end long ago, yet their end never arrived here."""


@dataclass(frozen=True)
class DeadlinePassed:
    """Put on a request's mailbox by its timer (gateway/inflight.py) at its deadline."""


HubFailure = RequestError | ClientGone | RequestLost | DeadlinePassed  # each ends the request
HubEvent = TextDelta | HubFailure


class Mailbox:
    """One HTTP request's events in arrival order, for its one reader (made in its loop).

    Lighter than an `asyncio.Queue` on the per-token path: a put appends and wakes the
    reader if it waits; the reader takes what is there without waiting (`take`, None
    when empty), so it can handle every event that arrived together before it writes."""

    def __init__(self) -> None:
        self._events: deque[HubEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Looked up once: on Python 3.11 each get_running_loop() is a getpid() syscall.
        self._loop = asyncio.get_running_loop()

    def put(self, event: HubEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> HubEvent | None:
        return self._events.popleft() if self._events else None

    def empty(self) -> bool:
        return not self._events

    async def wait(self) -> None:
        """Until an event is there (at once if one is)."""
        while not self._events:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class Hub:
    def __init__(self, subjects: Subjects, gateway_id: str) -> None:
        self._deltas_subject = subjects.gateway_deltas(gateway_id)
        self._errors_subject = subjects.gateway_errors(gateway_id)
        self._waiting: dict[str, Mailbox] = {}
        self.dropped = 0  # messages for no waiting rid (late, or after an abort)

    def register(self, rids: Iterable[str]) -> Mailbox:
        """One mailbox for all the rids of one HTTP request."""
        mailbox = Mailbox()
        for rid in rids:
            if rid in self._waiting:
                raise ValueError(f"rid {rid!r} is already waiting")
            self._waiting[rid] = mailbox
        return mailbox

    def unregister(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._waiting.pop(rid, None)

    @property
    def waiting(self) -> int:
        """How many rids have a waiting handler."""
        return len(self._waiting)

    def deliver(self, rid: str, event: HubEvent) -> bool:
        mailbox = self._waiting.get(rid)
        if mailbox is None:
            self.dropped += 1
            return False
        mailbox.put(event)
        return True

    async def on_message(self, msg: BusMsg) -> None:
        """The handler of the `{p}.gateway.{id}.>` subscription."""
        try:
            if msg.subject == self._deltas_subject:
                batch = decode(msg.data, TextDeltaBatch)
                for delta in batch.deltas:
                    self.deliver(delta.rid, delta)
            elif msg.subject == self._errors_subject:
                error = decode(msg.data, RequestError)
                if not self.deliver(error.rid, error):
                    log.debug(
                        "error %s for a request no one waits on",
                        error.code,
                        extra={"rid": error.rid},
                    )
            else:
                log.debug("ignoring a message on %s", msg.subject)
        except ProtocolError as exc:
            log.warning("dropping a malformed message on %s: %s", msg.subject, exc)
