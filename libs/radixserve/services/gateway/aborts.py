"""Publish `AbortRequest`s without awaiting on the caller's side.

A streaming handler learns of a disconnect by being cancelled, and a cancelled task
cannot await a publish; so `send` only queues the abort, and one supervised task
publishes it on `{p}.abort` at once.
"""

from __future__ import annotations

import asyncio
import logging

from radixserve.bus import Bus
from radixserve.protocol import AbortRequest, Subjects, encode

log = logging.getLogger(__name__)


class AbortSender:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subject = subjects.abort
        self._queue: asyncio.Queue[AbortRequest] = asyncio.Queue()

    def send(self, rid: str, reason: str) -> None:
        """Queue an abort of `rid`; never blocks or raises."""
        self._queue.put_nowait(AbortRequest(rid=rid, reason=reason))

    async def run(self) -> None:
        while True:
            abort = await self._queue.get()
            try:
                await self.bus.publish(self.subject, encode(abort))
                log.info("abort sent (%s)", abort.reason, extra={"rid": abort.rid})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS down: the scheduler times the request out
                log.warning("abort publish failed: %r", exc, extra={"rid": abort.rid})
