"""KV events: how the scheduler keeps a mirror of each worker's radix tree.

A worker's cache is seen in blocks of `block_size` tokens (whole blocks only; a
partial tail is not reported). Each block is named by a hash chained over its
parent's hash and its own tokens, so a block hash names the whole prefix up to
and including it. Worker and scheduler both compute hashes with `block_hashes`,
so the scheduler can hash an incoming prompt and walk its mirror with the same names.

Events travel in `KvEventBatch`es with a per-worker `seq` that grows by one per
batch; `epoch` changes when the worker restarts (its cache is empty again). A gap
in `seq` or a new `epoch` means the mirror is stale: the scheduler asks for a
snapshot (`KvSnapshotRequest`), answered by a batch that starts with
`AllBlocksCleared` and stores every cached block (in several batches, in order, when
it is large: `split_events` keeps each batch well under NATS's 1 MiB payload limit).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

from radixserve.protocol.base import Message
from radixserve.protocol.tokens import TOKEN_BYTES, num_tokens, pack_tokens, unpack_tokens


class StoredBlocks(Message, frozen=True, tag="stored"):
    """A chain of blocks now cached: block i's parent is block i-1, block 0's is `parent_hash`.

    `parent_hash` is None when the chain starts at the root. `token_ids` holds
    `block_size * len(block_hashes)` packed ids, block after block.
    """

    block_hashes: list[int]
    token_ids: bytes
    block_size: int
    parent_hash: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        expected = self.block_size * len(self.block_hashes)
        if num_tokens(self.token_ids) != expected:
            raise ValueError(
                f"stored blocks: {len(self.block_hashes)} blocks of {self.block_size} need "
                f"{expected} token ids, got {len(self.token_ids) // TOKEN_BYTES}"
            )

    @property
    def token_ids_list(self) -> list[int]:
        return unpack_tokens(self.token_ids)


class RemovedBlocks(Message, frozen=True, tag="removed"):
    """Blocks evicted from the cache (always leaves first, so children go before parents)."""

    block_hashes: list[int]


class OffloadedBlocks(Message, frozen=True, tag="offloaded"):
    """Cached blocks now in a lower tier alone (HiCache's host memory): still a hit, at
    the cost of a copy back rather than a prefill. `RestoredBlocks` undoes it."""

    block_hashes: list[int]


class RestoredBlocks(Message, frozen=True, tag="restored"):
    """Offloaded blocks back on the device."""

    block_hashes: list[int]


class AllBlocksCleared(Message, frozen=True, tag="cleared"):
    """The whole cache was emptied (flush, restart, or the start of a snapshot)."""


KvEvent = StoredBlocks | RemovedBlocks | OffloadedBlocks | RestoredBlocks | AllBlocksCleared


class KvEventBatch(Message, frozen=True):
    """worker -> scheduler: the cache changes of one or more steps, in order."""

    worker_id: str
    epoch: int  # the worker's start time in ns; changes on restart
    seq: int  # +1 per batch within an epoch
    events: list[KvEvent] = msgspec.field(default_factory=list)
    time: float = 0.0


class KvSnapshotRequest(Message, frozen=True):
    """scheduler -> a worker: publish your whole cache on your `kv_events` subject (a
    batch that starts with `AllBlocksCleared`, then more batches in sequence if large)."""

    worker_id: str
    reason: str = ""


_HASH_BYTES = 8


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent_hash: int | None = None
) -> list[int]:
    """Chained hashes of the whole blocks of `token_ids` (a partial tail is ignored).

    hash_i = blake2b-64(hash_{i-1} as 8 bytes LE, or nothing at the root || block_i as
    packed int32), read as a signed 64-bit int so msgpack keeps it in 9 bytes. A
    stable hash on purpose: Python's `hash()` differs between processes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    packed = pack_tokens(token_ids)
    block_bytes = block_size * TOKEN_BYTES
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(packed) - block_bytes + 1, block_bytes):
        h = hashlib.blake2b(digest_size=_HASH_BYTES)
        if parent is not None:
            h.update(parent.to_bytes(_HASH_BYTES, "little", signed=True))
        h.update(packed[start : start + block_bytes])
        parent = int.from_bytes(h.digest(), "little", signed=True)
        hashes.append(parent)
    return hashes


# A batch's events, measured as their encoded size (msgpack: 9 bytes a hash, a few bytes
# of framing an event); half of NATS's default 1 MiB payload.
MAX_BATCH_BYTES = 512 * 1024
_HASH_WIRE_BYTES = 9


def _event_bytes(event: KvEvent) -> int:
    if isinstance(event, StoredBlocks):
        return len(event.token_ids) + _HASH_WIRE_BYTES * (len(event.block_hashes) + 1) + 64
    if isinstance(event, RemovedBlocks | OffloadedBlocks | RestoredBlocks):
        return _HASH_WIRE_BYTES * len(event.block_hashes) + 32
    return 16


def _split_stored(event: StoredBlocks, max_bytes: int) -> list[StoredBlocks]:
    """One long chain as consecutive chains of at most ~max_bytes each."""
    per_block = event.block_size * TOKEN_BYTES + _HASH_WIRE_BYTES
    step = max(1, (max_bytes - 128) // per_block)
    if len(event.block_hashes) <= step:
        return [event]
    out: list[StoredBlocks] = []
    parent = event.parent_hash
    block_bytes = event.block_size * TOKEN_BYTES
    for start in range(0, len(event.block_hashes), step):
        hashes = event.block_hashes[start : start + step]
        tokens = event.token_ids[start * block_bytes : (start + len(hashes)) * block_bytes]
        out.append(StoredBlocks(hashes, tokens, event.block_size, parent))
        parent = hashes[-1]
    return out


def split_events(
    events: Sequence[KvEvent], max_bytes: int = MAX_BATCH_BYTES
) -> list[list[KvEvent]]:
    """`events` in order, as consecutive groups of about `max_bytes` at most (a long
    chain of stored blocks becomes several chains; removals of many blocks, several)."""
    if max_bytes < 1024:
        raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
    groups: list[list[KvEvent]] = []
    current: list[KvEvent] = []
    size = 0
    for event in events:
        pieces: Sequence[KvEvent]
        if isinstance(event, StoredBlocks):
            pieces = _split_stored(event, max_bytes)
        elif (
            isinstance(event, RemovedBlocks | OffloadedBlocks | RestoredBlocks)
            and _event_bytes(event) > max_bytes
        ):
            step = (max_bytes - 64) // _HASH_WIRE_BYTES
            hashes = event.block_hashes
            kind = type(event)
            pieces = [kind(hashes[i : i + step]) for i in range(0, len(hashes), step)]
        else:
            pieces = [event]
        for piece in pieces:
            cost = _event_bytes(piece)
            if current and size + cost > max_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(piece)
            size += cost
    if current:
        groups.append(current)
    return groups
