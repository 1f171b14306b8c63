"""The Redis request record, written off the request path.

    writer = RecordWriter(store, ttl_s=3600, metrics=metrics)
    ctx.spawn(writer.run(), "record-writer")
    writer.put(rid, {"state": "received", ...})     # never blocks, never raises
    writer.update(rid, {"state": "finished", ...})
    record = await writer.get(rid)                   # GET /v1/requests/{id}

Every write goes through one bounded queue drained by one task, so Redis being slow
or down never delays a token. A write that fails for want of Redis (no connection, a
timeout) stays first in line and is tried again with a backoff (0.25 s doubling to 5 s),
so the records of an outage are written once Redis is back; a write the queue has no
room for, or one Redis refuses, is dropped, counted in
`radixserve:store_write_failures_total` and logged at most every few seconds. Writes
of one record stay in order (one drainer), and a write of a record that still has one
in the queue joins it (one Redis call for both, with what the later one says winning);
an update of a record whose `put` was lost writes nothing (`Store.update_request` only
touches an existing record).

Record fields (all strings in Redis; `get` turns the numeric ones back into numbers):
`state` (received/queued/running/finished/failed), `endpoint`, `model`, `stream`,
`n`, `num_prompts`, `received_at` / `queued_at` / `first_token_at` / `finished_at`
(wall clock), `prompt_tokens`, `completion_tokens`, `cached_tokens`,
`finish_reason`, `worker` (the worker that ran it), and for failures `http_status` and `error_code`.
A resumable request's also has `resumable`, `created` and `plan` (gateway/resume.py), and
`resumed_at` once a client resumed it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from radixserve.store import FieldValue, Store
from radixserve.telemetry import GatewayMetrics

log = logging.getLogger(__name__)

_INT_FIELDS = frozenset(
    {
        "n",
        "num_prompts",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "http_status",
        "resumable",
        "created",
    }
)
_FLOAT_FIELDS = frozenset(
    {"received_at", "queued_at", "first_token_at", "finished_at", "resumed_at"}
)
_LOG_EVERY_S = 10.0
_FIRST_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 5.0
# What a write fails with while Redis is away (retried), rather than one it refuses.
_REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)


@dataclass
class _Write:
    rid: str
    fields: dict[str, FieldValue]
    create: bool  # put (replace) vs update (only if it exists)

    def join(self, later: _Write) -> None:
        """Become this write followed by `later` (a put replaces what came before it)."""
        if later.create:
            self.fields, self.create = later.fields, True
        else:
            self.fields.update(later.fields)


class RecordWriter:
    def __init__(
        self,
        store: Store,
        *,
        ttl_s: float,
        metrics: GatewayMetrics,
        max_pending: int = 10_000,
        write_timeout_s: float = 2.0,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.write_timeout_s = write_timeout_s
        self.max_pending = max_pending
        self._pending: deque[_Write] = deque()  # in order; the first may be in flight
        self._queued: dict[str, _Write] = {}  # the writes not yet tried, by record
        self._wake = asyncio.Event()
        self._last_log = 0.0
        self._unlogged = 0

    # -- the request path's side: never waits ------------------------------------------
    def put(self, rid: str, fields: Mapping[str, FieldValue]) -> None:
        self._enqueue(_Write(rid, dict(fields), create=True))

    def update(self, rid: str, fields: Mapping[str, FieldValue]) -> None:
        self._enqueue(_Write(rid, dict(fields), create=False))

    def _enqueue(self, write: _Write) -> None:
        queued = self._queued.get(write.rid)
        if queued is not None:
            queued.join(write)
            return
        if len(self._pending) >= self.max_pending:
            self._failed(write.rid, "the record queue is full (Redis slow or down?)")
            return
        self._pending.append(write)
        self._queued[write.rid] = write
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- the drainer ------------------------------------------------------------------------
    async def run(self) -> None:
        """Drain forever (a supervised task); one write at a time, each bounded."""
        backoff_s = 0.0
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            write = self._pending[0]
            if self._queued.get(write.rid) is write:
                del self._queued[write.rid]  # what comes for the record now is a new write
            try:
                await asyncio.wait_for(self._write(write), self.write_timeout_s)
            except asyncio.CancelledError:
                raise
            except _REDIS_AWAY as exc:
                self._keep_for_retry(write, repr(exc))
                backoff_s = min(max(2 * backoff_s, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
                await asyncio.sleep(backoff_s)
                continue
            except Exception as exc:
                self._failed(write.rid, repr(exc))
            backoff_s = 0.0
            self._pending.popleft()

    def _keep_for_retry(self, write: _Write, why: str) -> None:
        """`write` stays first; a later write of its record queued meanwhile joins it."""
        later = self._queued.get(write.rid)
        if later is not None:
            write.join(later)
            self._pending.remove(later)
        self._queued[write.rid] = write
        self._log(f"request record write failed, retrying: {why}", write.rid)

    async def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every queued write was made; True if the queue emptied."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._pending

    async def _write(self, write: _Write) -> None:
        with self.metrics.common.time_redis("put_request" if write.create else "update_request"):
            if write.create:
                await self.store.put_request(write.rid, write.fields, self.ttl_s)
            else:
                await self.store.update_request(write.rid, write.fields)

    def _failed(self, rid: str, why: str) -> None:
        self.metrics.store_write_failures.inc()
        self._log(f"request record write dropped: {why}", rid)

    def _log(self, message: str, rid: str) -> None:
        now = time.monotonic()
        if now - self._last_log < _LOG_EVERY_S:
            self._unlogged += 1
            return
        log.warning(
            "%s (%d more since the last warning)", message, self._unlogged, extra={"rid": rid}
        )
        self._last_log = now
        self._unlogged = 0

    # -- reading --------------------------------------------------------------------------
    async def get(self, rid: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The record with numbers as numbers; None if unknown. Raises on Redis errors."""
        raw = await asyncio.wait_for(self.store.get_request(rid), timeout_s)
        return None if raw is None else record_to_json(rid, raw)


def record_to_json(rid: str, raw: Mapping[str, str]) -> dict[str, Any]:
    record: dict[str, Any] = {"id": rid}
    for name, value in raw.items():
        try:
            if name in _INT_FIELDS:
                record[name] = int(value)
                continue
            if name in _FLOAT_FIELDS:
                record[name] = float(value)
                continue
        except ValueError:
            pass
        record[name] = value
    if "stream" in record:
        record["stream"] = record["stream"] == "1"
    return record
