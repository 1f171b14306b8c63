"""The radix cache's KV events: replayed, they rebuild exactly the set of whole blocks the
tree holds (checked against the radix-cache state machine's brute-force reference), and a
snapshot describes the same set; the engine records, drains and snapshots them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from radixserve.engine.kvcache.block_events import BlockEventLog, event_block_size
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.protocol import encode, pack_tokens
from radixserve.protocol.kv_events import (
    AllBlocksCleared,
    KvEvent,
    KvEventBatch,
    RemovedBlocks,
    StoredBlocks,
    block_hashes,
    split_events,
)
from tests.unit.test_radix_cache import RadixMachine, make_pool, put


def replay(mirror: set[int], events: list[KvEvent]) -> None:
    """Apply events as a scheduler's mirror does, checking each one is consistent."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            mirror.clear()
        elif isinstance(event, StoredBlocks):
            # The hashes are the chain over the event's own tokens after its parent...
            assert event.block_hashes == block_hashes(
                event.token_ids_list, event.block_size, event.parent_hash
            )
            # ...whose parent is cached (or the root), and none of them is yet.
            assert event.parent_hash is None or event.parent_hash in mirror
            assert mirror.isdisjoint(event.block_hashes), "a block stored twice"
            mirror.update(event.block_hashes)
        else:
            assert isinstance(event, RemovedBlocks)
            assert set(event.block_hashes) <= mirror, "a block removed that was not stored"
            mirror.difference_update(event.block_hashes)


def blocks_of(prefixes: set[tuple[int, ...]], block_size: int) -> set[int]:
    """The hash of every cached prefix that ends on a block boundary."""
    return {
        block_hashes(list(p), block_size)[-1] for p in prefixes if p and len(p) % block_size == 0
    }


class EventsMachine(RadixMachine):
    """The radix-cache state machine with events on: after every rule, the mirror replayed
    from the drained events and the snapshot both equal the reference's whole blocks."""

    BLOCK = 2

    def __init__(self) -> None:
        super().__init__()
        self.log = BlockEventLog(self.BLOCK)
        self.cache.enable_events(self.log)
        self.mirror: set[int] = set()

    @invariant()
    def events_rebuild_the_tree(self) -> None:
        replay(self.mirror, self.log.drain())
        expected = blocks_of(set(self.ref), self.BLOCK)
        assert self.mirror == expected
        snapshot: set[int] = {0}  # a snapshot starts by clearing whatever was there
        replay(snapshot, self.cache.snapshot_events())
        assert snapshot == expected


class PagedEventsMachine(EventsMachine):
    POOL_SIZE = 24
    PAGE = 2
    BLOCK = 4


TestEventsMachine = EventsMachine.TestCase
TestEventsMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestPagedEventsMachine = PagedEventsMachine.TestCase
TestPagedEventsMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_block_size_is_whole_pages_of_at_least_16_tokens() -> None:
    assert [event_block_size(p) for p in (1, 2, 3, 16, 64)] == [16, 16, 18, 16, 64]
    with pytest.raises(ValueError, match="page_size"):
        event_block_size(0)


def test_split_moves_blocks_to_the_upper_part() -> None:
    pool = make_pool(64)
    cache = RadixCache(pool)
    log = BlockEventLog(4)
    cache.enable_events(log)
    put(cache, pool, list(range(1, 11)))  # 10 tokens: blocks ending at 4 and 8
    (stored,) = log.drain()
    assert isinstance(stored, StoredBlocks) and stored.parent_hash is None
    assert stored.block_hashes == block_hashes(list(range(1, 9)), 4)
    # A key that leaves after 6 tokens splits the node: [1..6] holds the block ending at 4.
    put(cache, pool, [1, 2, 3, 4, 5, 6, 99, 98, 97])
    (branch,) = log.drain()
    assert isinstance(branch, StoredBlocks)
    assert branch.parent_hash == stored.block_hashes[0]
    assert branch.token_ids_list == [5, 6, 99, 98]  # the block straddles the split
    upper = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    assert upper.blocks == stored.block_hashes[:1]
    cache.check_invariants()
    # Evicting the old branch's leaf removes the block ending at 8, and nothing else.
    assert cache.evict(1) >= 1
    removed = log.drain()
    assert removed and all(isinstance(e, RemovedBlocks) for e in removed)
    hashes = {h for e in removed if isinstance(e, RemovedBlocks) for h in e.block_hashes}
    assert hashes in ({stored.block_hashes[1]}, set(branch.block_hashes))


def test_enable_events_refuses_a_filled_cache_and_odd_blocks() -> None:
    pool = make_pool(16, page_size=2)
    cache = RadixCache(pool, 2)
    with pytest.raises(ValueError, match="whole number of pages"):
        cache.enable_events(BlockEventLog(3))
    put(cache, pool, [1, 2])
    with pytest.raises(RuntimeError, match="already holds"):
        cache.enable_events(BlockEventLog(2))


def test_reset_is_one_cleared_event() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    log = BlockEventLog(2)
    cache.enable_events(log)
    put(cache, pool, [1, 2, 3, 4])
    cache.reset()
    pool.clear()
    assert log.drain() == [AllBlocksCleared()]


def test_engine_records_drains_and_snapshots(tiny_llama_dir: object) -> None:
    from radixserve.engine.engine import Engine

    engine = Engine(str(tiny_llama_dir), device="cpu", dtype="float32", cpu_kv_tokens=4096)
    try:
        assert engine.drain_kv_events() == []  # off until enabled
        block = engine.enable_kv_events()
        assert block == 16
        prompt = [(7 * i) % 200 + 3 for i in range(40)]
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})
        mirror: set[int] = set()
        replay(mirror, engine.drain_kv_events())
        hashes = block_hashes(prompt, block)
        assert set(hashes) <= mirror  # the prompt's two whole blocks are cached
        snapshot: set[int] = set()
        replay(snapshot, engine.kv_snapshot())
        assert snapshot == mirror
        assert engine.drain_kv_events() == []  # the snapshot replaced what was pending
        assert engine.flush_cache()
        assert engine.drain_kv_events() == [AllBlocksCleared()]
    finally:
        engine.shutdown()


def test_engine_without_radix_cache_snapshots_empty(tiny_llama_dir: object) -> None:
    from radixserve.engine.engine import Engine

    engine = Engine(
        str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        cpu_kv_tokens=4096,
        disable_radix_cache=True,
    )
    try:
        engine.enable_kv_events()
        engine.generate(input_ids=list(range(3, 40)), sampling_params={"max_new_tokens": 2})
        assert engine.drain_kv_events() == []
        assert engine.kv_snapshot() == [AllBlocksCleared()]
    finally:
        engine.shutdown()


def test_events_change_no_bookkeeping() -> None:
    """Events change no slot bookkeeping: the same inserts give the same tree."""
    pool_a, pool_b = make_pool(32), make_pool(32)
    plain, logged = RadixCache(pool_a), RadixCache(pool_b)
    logged.enable_events(BlockEventLog(2))
    for key in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [4, 4]):
        a, b = put(plain, pool_a, key), put(logged, pool_b, key)
        assert torch.equal(a, b)
    assert plain.pretty().splitlines()[1:] == logged.pretty().splitlines()[1:]


@given(
    chains=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    max_bytes=st.sampled_from([1024, 4096, 65536]),
)
def test_split_events_keeps_order_and_bounds(chains: list[int], max_bytes: int) -> None:
    """Split batches replay to the same blocks, and each encodes small enough."""
    block = 16
    events: list[KvEvent] = [AllBlocksCleared()]
    parent: int | None = None
    for n, blocks in enumerate(chains):
        tokens = [(n * 7919 + i) % 50000 for i in range(blocks * block)]
        hashes = block_hashes(tokens, block, parent)
        events.append(StoredBlocks(hashes, pack_tokens(tokens), block, parent))
        parent = hashes[-1]
    events.append(RemovedBlocks(list(hashes)))  # the last chain, evicted again
    whole: set[int] = set()
    replay(whole, events)
    groups = split_events(events, max_bytes)
    assert [e for g in groups for e in g][:1] == [AllBlocksCleared()]
    pieces: set[int] = set()
    for group in groups:
        replay(pieces, group)
        batch = KvEventBatch(worker_id="w", epoch=1, seq=0, events=group)
        assert len(encode(batch)) <= max_bytes + 64
    assert pieces == whole


def test_split_events_refuses_a_tiny_bound() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        split_events([AllBlocksCleared()], 100)
