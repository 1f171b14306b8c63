"""Route the bus messages addressed to this gateway to the HTTP handler waiting on each rid.

    hub = Hub(subjects, gateway_id)
    await bus.subscribe(subjects.gateway_all(gateway_id), hub.on_message)
    queue = hub.register(plan.rids)        # before publishing the SubmitRequests
    event = await queue.get()              # TextDelta | RequestError | ClientGone | RequestLost
    hub.unregister(plan.rids)

Delivery never blocks: each waiting request has an unbounded queue (its producer is
the bus, whose rate the detokenizer's batching already bounds). Messages for a rid
nobody waits on (a request already answered or aborted) are dropped.
"""

from __future__ import annotations

import asyncio
import logging
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


HubEvent = TextDelta | RequestError | ClientGone | RequestLost


class Hub:
    def __init__(self, subjects: Subjects, gateway_id: str) -> None:
        self._deltas_subject = subjects.gateway_deltas(gateway_id)
        self._errors_subject = subjects.gateway_errors(gateway_id)
        self._waiting: dict[str, asyncio.Queue[HubEvent]] = {}
        self.dropped = 0  # messages for no waiting rid (late, or after an abort)

    def register(self, rids: Iterable[str]) -> asyncio.Queue[HubEvent]:
        """One queue for all the rids of one HTTP request."""
        queue: asyncio.Queue[HubEvent] = asyncio.Queue()
        for rid in rids:
            if rid in self._waiting:
                raise ValueError(f"rid {rid!r} is already waiting")
            self._waiting[rid] = queue
        return queue

    def unregister(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._waiting.pop(rid, None)

    @property
    def waiting(self) -> int:
        """How many rids have a waiting handler."""
        return len(self._waiting)

    def deliver(self, rid: str, event: HubEvent) -> bool:
        queue = self._waiting.get(rid)
        if queue is None:
            self.dropped += 1
            return False
        queue.put_nowait(event)
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
