"""Each resumable request's text deltas in order, kept in Redis where any gateway reads them.

    log = OutputLog(store, ttl_s=120)
    await log.append([LogEntry(rid, seq=0, delta=b"..."), ...])   # one pipeline
    entries = await log.read({rid: "0"}, block_ms=1000)          # {rid: [LoggedDelta, ...]}

One Redis Stream per request (`<prefix>out:<rid>`): the detokenizer appends each delta
with its number in the request (`seq`, from 0), the stream's TTL renewed on every write;
a gateway resuming a client's stream reads the entries after an id, blocking for more.
A number that does not follow its predecessor marks a hole (a write that was dropped):
the reader refuses to resume such a stream rather than send text with a hole. One
exception: a restarted detokenizer numbers a request it rebuilt from the worker's
history (its delta marked `resent`, holding the choice from its start) from the log's
last number plus `RESYNC_SEQ_GAP`, more than the old one could have numbered without
writing; so an event id the old one gave out for a delta that never reached the log
falls in the gap, which the reader refuses, and never on a number the new one gives.

`OutputLogWriter` is the detokenizer's side: a bounded queue drained by one task, so a
slow or absent Redis never delays a delta (a dropped write is counted and logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from radixserve.store.client import Store

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 120.0
DEFAULT_MAX_ENTRIES = 65536  # a request's deltas kept at most (the oldest trimmed)
DEFAULT_MAX_PENDING = 4096  # batches of entries the writer queues at most
# Numbers skipped after a detokenizer restart: above what a writer can hold unwritten
# (its queue and the batch it writes, each at most DEFAULT_MAX_PENDING lists of at most
# one entry per choice of a request, n <= 128).
RESYNC_SEQ_GAP = 4 * DEFAULT_MAX_PENDING * 128
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class LogEntry:
    rid: str
    seq: int  # the delta's number in its request, from 0
    delta: str  # the TextDelta, as JSON


@dataclass(frozen=True)
class LoggedDelta:
    entry_id: str  # Redis's stream id: read after it for what follows
    seq: int
    delta: str


class OutputLog:
    def __init__(
        self, store: Store, *, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the output log's TTL must be > 0 s, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"the output log's max entries must be >= 1, got {max_entries}")
        self.store = store
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_entries = max_entries

    def key(self, rid: str) -> str:
        if not rid:
            raise ValueError("request id must not be empty")
        return self.store.key("out", rid)

    async def append(self, entries: Sequence[LogEntry]) -> None:
        """Every entry in one round trip, each request's TTL renewed once."""
        if not entries:
            return
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.xadd(
                    self.key(entry.rid),
                    {"s": str(entry.seq), "d": entry.delta},
                    maxlen=self.max_entries,
                    approximate=True,
                )
            for rid in dict.fromkeys(entry.rid for entry in entries):
                pipe.pexpire(self.key(rid), self.ttl_ms)
            await pipe.execute()

    async def read(
        self, after: Mapping[str, str], *, block_ms: int | None = None, count: int = 1024
    ) -> dict[str, list[LoggedDelta]]:
        """The entries after each rid's entry id ("0": from the start), up to `count` a
        request; with `block_ms`, waits that long for one when there is none."""
        streams = {self.key(rid): entry_id for rid, entry_id in after.items()}
        by_key = {self.key(rid): rid for rid in after}
        reply = await self.store.redis.xread(streams, count=count, block=block_ms)  # type: ignore[arg-type]
        found: dict[str, list[LoggedDelta]] = {}
        for key, rows in cast("list[tuple[str, list[tuple[str, dict[str, str]]]]]", reply or []):
            found[by_key[key]] = [
                LoggedDelta(entry_id, int(fields["s"]), fields["d"]) for entry_id, fields in rows
            ]
        return found

    async def exists(self, rid: str) -> bool:
        return int(await self.store.redis.exists(self.key(rid))) == 1

    async def last_seqs(self, rids: Sequence[str]) -> dict[str, int]:
        """Each request's last entry number (-1: no entry), in one round trip."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xrevrange(self.key(rid), count=1)
            replies = await pipe.execute()
        return {
            rid: int(rows[0][1]["s"]) if rows else -1
            for rid, rows in zip(rids, cast("list[Any]", replies), strict=True)
        }


class OutputLogWriter:
    """The deltas of resumable requests, numbered per request and written off the path
    that publishes them."""

    def __init__(
        self,
        output_log: OutputLog,
        *,
        on_dropped: Callable[[int], Any],
        max_pending: int = DEFAULT_MAX_PENDING,
        write_timeout_s: float = 2.0,
        max_requests: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.output_log = output_log
        self.on_dropped = on_dropped  # called with how many entries a failure dropped
        self.write_timeout_s = write_timeout_s
        self._queue: asyncio.Queue[list[LogEntry]] = asyncio.Queue(maxsize=max_pending)
        self._next_seq: OrderedDict[str, int] = OrderedDict()  # LRU-bounded
        self._max_requests = max_requests
        self._last_log = 0.0

    def put(self, entries: list[LogEntry]) -> None:
        """Entries numbered by `number`, in the order they were published; never waits."""
        if not entries:
            return
        try:
            self._queue.put_nowait(entries)
        except asyncio.QueueFull:
            self._dropped(len(entries), "the output log's queue is full (Redis slow or down?)")

    def number(self, rid: str) -> int:
        """The next entry number of `rid` (from 0, or after `continue_after`)."""
        seq = self._next_seq.pop(rid, 0)
        self._next_seq[rid] = seq + 1
        if len(self._next_seq) > self._max_requests:
            self._next_seq.popitem(last=False)
        return seq

    def knows(self, rid: str) -> bool:
        return rid in self._next_seq

    def continue_after(self, rid: str, last_seq: int) -> None:
        """Number `rid`'s next entry after the log's `last_seq`, past the gap a restart
        leaves (RESYNC_SEQ_GAP)."""
        self._next_seq[rid] = max(last_seq + 1 + RESYNC_SEQ_GAP, self._next_seq.get(rid, 0))

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        """Drain forever (a supervised task), consecutive batches in one round trip."""
        while True:
            entries = await self._queue.get()
            while not self._queue.empty() and len(entries) < 4096:
                entries += self._queue.get_nowait()
            try:
                await asyncio.wait_for(self.output_log.append(entries), self.write_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._dropped(len(entries), repr(exc))

    async def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.qsize() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._queue.qsize() == 0

    def _dropped(self, count: int, why: str) -> None:
        self.on_dropped(count)
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            log.warning("%d output log entries dropped: %s", count, why)
            self._last_log = now
