"""`KvMirrors`: the scheduler's copy of each worker's radix (prefix) cache.

Each mirror is the set of block hashes a worker holds, kept from the `KvEventBatch`es
it publishes (see `protocol.kv_events`). A block hash names its whole prefix and
blocks are evicted leaves first, so the set is prefix-closed: the longest cached
prefix of a prompt is found by a binary search over the prompt's chained hashes.

A mirror that may have missed a batch (a gap in `seq`, a heartbeat announcing a batch
that never came, a restart first seen mid-stream) is *stale*: it matches nothing until
a batch that starts with `AllBlocksCleared` (a snapshot, or a flush) resyncs it.
`snapshots_due` says which workers to send a `KvSnapshotRequest`. No I/O here.

A prompt routed to a worker is *expected* there (`note_routed`) for `expected_ttl_s`,
until its blocks' events arrive: as in SGLang's router, which inserts a prompt into its
tree of the chosen worker when it routes it, a burst of requests sharing a new system
prompt then follows the first one to its worker instead of spreading over the workers
before any of them has cached it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.protocol import (
    AllBlocksCleared,
    Heartbeat,
    KvEventBatch,
    OffloadedBlocks,
    RemovedBlocks,
    RestoredBlocks,
    StoredBlocks,
    block_hashes,
)

log = logging.getLogger(__name__)


class PromptHashes:
    """A prompt's chained block hashes, computed on first use once per block size
    (workers of one model usually share a block size), not once per worker."""

    def __init__(self, token_ids: Sequence[int] | np.ndarray) -> None:
        self.token_ids = token_ids
        self._by_block_size: dict[int, list[int]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        hashes = self._by_block_size.get(block_size)
        if hashes is None:
            hashes = self._by_block_size[block_size] = block_hashes(self.token_ids, block_size)
        return hashes


def _resyncs(batch: KvEventBatch) -> bool:
    """A batch that starts by emptying the cache states the whole cache on its own."""
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)


def _leading(hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    """The largest i with held(hashes[i - 1]), for a prefix-closed `held`."""
    low, high = 0, len(hashes)
    while low < high:
        mid = (low + high + 1) // 2
        if held(hashes[mid - 1]):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class WorkerMirror:
    """One worker's cached blocks, as its event stream of `epoch` told them."""

    epoch: int
    seq: int = -1  # the last batch applied in this epoch; -1: none
    block_size: int | None = None  # None until a heartbeat or a StoredBlocks says
    blocks: set[int] = field(default_factory=set)
    offloaded: set[int] = field(default_factory=set)  # of `blocks`: in host memory alone
    stale: bool = False  # may have missed a batch: matches nothing until resynced
    snapshot_requested_at: float | None = None  # None: not asked since it went stale
    announced_seq: int = -1  # kv_event_seq of the last heartbeat of this epoch
    # Blocks of prompts routed here whose events have not come yet -> when to stop
    # expecting them (a chain's deeper blocks never outlive its shallower ones).
    expected: dict[int, float] = field(default_factory=dict)

    def apply(self, batch: KvEventBatch) -> None:
        if _resyncs(batch):
            self.stale = False
            self.snapshot_requested_at = None
        for event in batch.events:
            if isinstance(event, StoredBlocks):
                self.blocks.update(event.block_hashes)
                self.block_size = event.block_size
                for block in event.block_hashes:
                    self.expected.pop(block, None)
            elif isinstance(event, RemovedBlocks):
                self.blocks.difference_update(event.block_hashes)
                self.offloaded.difference_update(event.block_hashes)
                for block in event.block_hashes:
                    self.expected.pop(block, None)
            elif isinstance(event, OffloadedBlocks):
                self.offloaded.update(b for b in event.block_hashes if b in self.blocks)
            elif isinstance(event, RestoredBlocks):
                self.offloaded.difference_update(event.block_hashes)
            else:
                self.blocks.clear()
                self.offloaded.clear()
                self.expected.clear()
        self.seq = batch.seq

    def holds(self, block: int, now: float) -> bool:
        return block in self.blocks or self.expected.get(block, 0.0) > now

    def matched_blocks(self, hashes: Sequence[int], now: float = 0.0) -> int:
        """How many leading `hashes` are cached (or expected before `now` runs out): the
        largest i with hashes[i-1] held (binary search, valid because the set is
        prefix-closed)."""
        return _leading(hashes, lambda block: self.holds(block, now))

    def device_blocks(self, hashes: Sequence[int], now: float = 0.0) -> int:
        """How many leading `hashes` are cached on the device (what is there is a subtree
        from the root: prefix-closed too)."""
        return _leading(
            hashes, lambda block: self.holds(block, now) and block not in self.offloaded
        )

    def expect(self, hashes: Sequence[int], until: float) -> None:
        for block in hashes:
            if block not in self.blocks:
                self.expected[block] = until

    def forget_expired(self, now: float) -> None:
        if self.expected:
            self.expected = {b: t for b, t in self.expected.items() if t > now}


class KvMirrors:
    """Mirrors by worker id; a stale one is re-asked for a snapshot every
    `snapshot_retry_s` until one arrives."""

    def __init__(
        self,
        snapshot_retry_s: float = 5.0,
        expected_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if snapshot_retry_s <= 0:
            raise ValueError(f"snapshot_retry_s must be > 0, got {snapshot_retry_s}")
        if expected_ttl_s < 0:
            raise ValueError(f"expected_ttl_s must be >= 0, got {expected_ttl_s}")
        self.snapshot_retry_s = snapshot_retry_s
        self.expected_ttl_s = expected_ttl_s
        self.clock = clock
        self._mirrors: dict[str, WorkerMirror] = {}

    def on_events(self, batch: KvEventBatch) -> None:
        """Apply `batch` if it is the next one; else ignore it (old) or go stale (a gap)."""
        mirror = self._mirrors.get(batch.worker_id)
        if mirror is None or batch.epoch > mirror.epoch:
            # A new process (or one not seen before): its cache was empty before seq 0.
            mirror = self._reset(batch.worker_id, batch.epoch)
            if batch.seq == 0 or _resyncs(batch):
                mirror.apply(batch)
            else:
                self._mark_stale(batch.worker_id, mirror, f"first seen at seq {batch.seq}")
            return
        if batch.epoch < mirror.epoch or batch.seq <= mirror.seq:
            return  # the previous process's, or applied already (a snapshot seen twice)
        if batch.seq == mirror.seq + 1 or _resyncs(batch):
            mirror.apply(batch)
        else:
            self._mark_stale(batch.worker_id, mirror, f"seq {mirror.seq} -> {batch.seq}")

    def on_heartbeat(self, beat: Heartbeat) -> None:
        """Learn the block size; reset on a restart; go stale when the batch the previous
        heartbeat announced has still not arrived (lost, not merely in flight: events and
        heartbeats travel on different subjects and may overtake each other)."""
        mirror = self._mirrors.get(beat.worker_id)
        if mirror is None or beat.epoch > mirror.epoch:
            mirror = self._reset(beat.worker_id, beat.epoch)
            if beat.kv_event_seq != -1:
                self._mark_stale(beat.worker_id, mirror, "batches published before it was seen")
        elif beat.epoch < mirror.epoch:
            return
        elif mirror.seq < mirror.announced_seq:
            self._mark_stale(beat.worker_id, mirror, f"batch {mirror.announced_seq} never came")
        mirror.block_size = beat.capacity.kv_block_size
        mirror.announced_seq = beat.kv_event_seq

    def drop(self, worker_id: str) -> None:
        """Forget a worker (it expired)."""
        self._mirrors.pop(worker_id, None)

    def snapshots_due(self, now: float) -> list[str]:
        """Stale workers not asked for a snapshot within `snapshot_retry_s` (now asked)."""
        due = []
        for worker_id, mirror in sorted(self._mirrors.items()):
            mirror.forget_expired(self.clock())
            asked = mirror.snapshot_requested_at
            if mirror.stale and (asked is None or now - asked >= self.snapshot_retry_s):
                mirror.snapshot_requested_at = now
                due.append(worker_id)
        return due

    def matched_tokens(self, worker_id: str, prompt: PromptHashes) -> int:
        """The longest prefix of `prompt` cached on `worker_id`, in tokens (whole blocks);
        0 for a stale or unknown worker."""
        mirror = self._mirrors.get(worker_id)
        if mirror is None or mirror.stale or mirror.block_size is None:
            return 0
        if not mirror.blocks and not mirror.expected:
            return 0
        hashes = prompt.hashes(mirror.block_size)
        return mirror.matched_blocks(hashes, self.clock()) * mirror.block_size

    def matched_device_tokens(self, worker_id: str, prompt: PromptHashes) -> int:
        """Of `matched_tokens`, the part on the device (the rest is in host memory)."""
        mirror = self._mirrors.get(worker_id)
        if mirror is None or mirror.stale or mirror.block_size is None or not mirror.offloaded:
            return self.matched_tokens(worker_id, prompt)
        hashes = prompt.hashes(mirror.block_size)
        return mirror.device_blocks(hashes, self.clock()) * mirror.block_size

    def note_routed(self, worker_id: str, prompt: PromptHashes) -> None:
        """`prompt` went to `worker_id`: expect its whole blocks there until their events
        come (or `expected_ttl_s` passes: the request may fail or be evicted first)."""
        mirror = self._mirrors.get(worker_id)
        if mirror is None or mirror.stale or mirror.block_size is None or not self.expected_ttl_s:
            return
        mirror.expect(prompt.hashes(mirror.block_size), self.clock() + self.expected_ttl_s)

    def get(self, worker_id: str) -> WorkerMirror | None:
        return self._mirrors.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._mirrors

    def __len__(self) -> int:
        return len(self._mirrors)

    def _reset(self, worker_id: str, epoch: int) -> WorkerMirror:
        old = self._mirrors.get(worker_id)
        mirror = WorkerMirror(epoch, block_size=None if old is None else old.block_size)
        self._mirrors[worker_id] = mirror
        return mirror

    @staticmethod
    def _mark_stale(worker_id: str, mirror: WorkerMirror, why: str) -> None:
        if not mirror.stale:
            log.info("KV mirror of worker %s is stale (%s); a snapshot is due", worker_id, why)
        mirror.stale = True
