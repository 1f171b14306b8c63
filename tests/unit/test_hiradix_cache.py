"""HiCache's tree over a device pool and a host pool: what moves where, and that the KV
a match hands out is the KV of its tokens, whichever tier it came back from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.engine.kvcache.block_events import BlockEventLog
from radixserve.engine.kvcache.block_store import FileBlockStore
from radixserve.engine.kvcache.hiradix_cache import HiRadixCache
from radixserve.engine.kvcache.host_pool import (
    copy_to_device,
    copy_to_host,
    gather_rows,
    host_pool_for,
)
from radixserve.engine.kvcache.pool import KVPool
from radixserve.protocol.kv_events import (
    OffloadedBlocks,
    RemovedBlocks,
    RestoredBlocks,
    StoredBlocks,
)

LAYERS = 2


def make_pool(num_slots: int, page_size: int = 1, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(num_slots, LAYERS, 1, 2, dtype, "cpu", page_size=page_size)


def kv_code(prefix: list[int]) -> float:
    """What a model would store at the last position of `prefix`: a function of the whole
    prefix (exact in float32)."""
    return float(hash(tuple(prefix)) % (1 << 20))


def compute(pool: KVPool, seq: list[int], start: int, slots: torch.Tensor) -> None:
    """Write the KV of seq[start:] into `slots`, as a prefill would."""
    for i, slot in enumerate(slots.tolist()):
        code = kv_code(seq[: start + i + 1])
        for layer in range(LAYERS):
            pool.k_buffers[layer][slot] = code + layer
            pool.v_buffers[layer][slot] = -code - layer


def assert_kv(pool: KVPool, seq: list[int], slots: torch.Tensor) -> None:
    """`slots` hold the KV of seq's first len(slots) tokens."""
    want = torch.tensor([kv_code(seq[: i + 1]) for i in range(slots.numel())])
    for layer in range(LAYERS):
        k = pool.k_buffers[layer][slots][:, 0, 0]
        v = pool.v_buffers[layer][slots][:, 0, 1]
        assert torch.equal(k, want + layer), f"layer {layer}: K of a match is not its tokens'"
        assert torch.equal(v, -want - layer), f"layer {layer}: V of a match is not its tokens'"


def fresh(seq: list[int], pool: KVPool) -> torch.Tensor:
    slots = pool.alloc(len(seq))
    assert slots is not None
    compute(pool, seq, 0, slots)
    return slots


def cache_of(device: int, host: int, page: int = 1, policy: str = "write_back") -> HiRadixCache:
    return HiRadixCache(make_pool(device, page), make_pool(host, page), policy)


def test_evicted_prefix_is_loaded_back_from_host() -> None:
    cache = cache_of(16, 64)
    pool = cache.kv_pool
    seq = list(range(10))
    cache.insert(seq, fresh(seq, pool))
    assert cache.evict(10) == 10
    assert pool.available() == 16
    cache.check_invariants()
    miss = cache.match_prefix(seq)
    assert (miss.length, miss.host_length) == (0, 10)
    stats = cache.host_stats()
    assert (stats.written_tokens, stats.loaded_tokens, stats.host_used_tokens) == (10, 0, 10)
    hit = cache.match_prefix(seq, load=True)
    assert (hit.length, hit.host_length) == (10, 0)
    assert_kv(pool, seq, hit.indices)
    assert cache.host_stats().loaded_tokens == 10
    cache.check_invariants()
    # The host copy stays: evicting again copies nothing.
    cache.evict(10)
    assert cache.host_stats().written_tokens == 10
    cache.check_invariants()


def test_a_partly_loaded_match_splits_and_loads_whole_pages() -> None:
    cache = cache_of(24, 64, page=2)
    pool = cache.kv_pool
    seq = list(range(12))
    cache.insert(seq, fresh(seq, pool))
    cache.evict(12)
    hit = cache.match_prefix([*seq[:7], 99], load=True)
    assert hit.length == 6  # whole pages of the common part
    assert_kv(pool, seq, hit.indices)
    cache.check_invariants()
    rest = cache.match_prefix(seq)
    assert (rest.length, rest.host_length) == (6, 6)


def test_load_back_makes_room_on_the_device_without_evicting_its_own_path() -> None:
    cache = cache_of(12, 64)
    pool = cache.kv_pool
    a, b = list(range(8)), list(range(100, 108))
    cache.insert(a, fresh(a, pool))
    cache.evict(8)
    cache.insert(b, fresh(b, pool))
    cache.match_prefix(a[:4])  # split a: two host-only nodes on its path
    hit = cache.match_prefix(a, load=True)  # needs 8 of 12 slots: b goes to the host
    assert hit.length == 8
    assert_kv(pool, a, hit.indices)
    assert cache.match_prefix(b).host_length == 8
    cache.check_invariants()


def test_a_match_loads_what_fits_when_the_device_is_locked_full() -> None:
    cache = cache_of(10, 64)
    pool = cache.kv_pool
    a, b = list(range(6)), list(range(50, 56))
    cache.insert(a, fresh(a, pool))
    cache.evict(6)
    cache.insert(b, fresh(b, pool))
    held = cache.match_prefix(b)
    cache.inc_lock_ref(held.node)  # 6 of 10 device slots locked
    hit = cache.match_prefix(a, load=True)
    assert hit.length == 0 and hit.host_length == 6  # one node of 6 does not fit in 4
    cache.match_prefix(a[:3])  # split it: the first half fits
    hit = cache.match_prefix(a, load=True)
    assert (hit.length, hit.host_length) == (3, 3)
    assert_kv(pool, a, hit.indices)
    cache.dec_lock_ref(held.node)
    cache.check_invariants()


def test_insert_through_host_nodes_takes_the_requests_slots() -> None:
    cache = cache_of(32, 64)
    pool = cache.kv_pool
    seq = list(range(10))
    cache.insert(seq[:6], fresh(seq[:6], pool))
    cache.evict(6)
    # A request that matched nothing computed all of seq itself.
    slots = fresh(seq, pool)
    assert cache.insert(seq, slots) == 0  # nothing was on the device: the cache owns it all
    hit = cache.match_prefix(seq)
    assert hit.length == 10 and torch.equal(hit.indices, slots)
    cache.check_invariants()


def test_a_full_host_pool_evicts_its_lru_leaf_and_events_report_it() -> None:
    cache = cache_of(16, 8)
    log = BlockEventLog(2)
    cache.enable_events(log)
    pool = cache.kv_pool
    a, b = list(range(6)), list(range(40, 46))
    cache.insert(a, fresh(a, pool))
    cache.evict(6)  # a: host
    log.drain()
    cache.insert(b, fresh(b, pool))
    cache.evict(6)  # b needs the host room a holds: a leaves the tree
    events = log.drain()
    # b stored, a removed from the host to make room, b offloaded there.
    assert [type(e) for e in events] == [StoredBlocks, RemovedBlocks, OffloadedBlocks]
    assert cache.match_prefix(a).host_length == 0
    assert cache.match_prefix(b).host_length == 6
    assert cache.host_stats().dropped_tokens == 6
    cache.check_invariants()


def test_a_node_larger_than_the_host_pool_is_dropped_with_its_subtree() -> None:
    cache = cache_of(32, 4)
    pool = cache.kv_pool
    seq = list(range(12))
    cache.insert(seq, fresh(seq, pool))
    cache.match_prefix(seq[:9])  # 9 + 3: the 3-token tail fits on the host, the head does not
    cache.evict(3)
    assert cache.match_prefix(seq).host_length == 3
    cache.evict(9)
    assert cache.match_prefix(seq).host_length == 0
    assert pool.available() == 32 and cache.host_pool.available() == 4
    cache.check_invariants()


def test_write_through_copies_at_insert_and_evicts_for_free() -> None:
    cache = cache_of(16, 64, policy="write_through")
    pool = cache.kv_pool
    seq = list(range(8))
    cache.insert(seq, fresh(seq, pool))
    assert cache.host_stats().written_tokens == 8
    cache.evict(8)
    assert cache.host_stats().written_tokens == 8
    assert_kv(pool, seq, cache.match_prefix(seq, load=True).indices)
    cache.check_invariants()


def test_reset_clears_both_tiers() -> None:
    cache = cache_of(16, 64)
    seq = list(range(8))
    cache.insert(seq, fresh(seq, cache.kv_pool))
    cache.evict(8)
    cache.reset()
    cache.kv_pool.clear()
    assert cache.match_prefix(seq).host_length == 0
    assert cache.host_pool.available() == 64
    cache.check_invariants()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_copies_move_every_layer_bit_for_bit(dtype: torch.dtype) -> None:
    device, host = make_pool(8, dtype=dtype), make_pool(8, dtype=dtype)
    for b in (*device.k_buffers, *device.v_buffers):
        b.copy_(torch.randn(b.shape).to(dtype))
    src, dst, back = torch.tensor([3, 1, 7]), torch.tensor([2, 8, 5]), torch.tensor([4, 6, 2])
    copy_to_host(device, src, host, dst)
    copy_to_device(host, dst, device, back)
    for buffers in (device.k_buffers, device.v_buffers):
        for b in buffers:
            assert torch.equal(b[back].view(torch.uint8), b[src].view(torch.uint8))


def test_host_pool_for_sizes_and_refuses() -> None:
    device = KVPool(64, 4, 2, 8, torch.bfloat16, "cpu", page_size=4)
    per_token = KVPool.bytes_per_token_for(4, 2, 8, torch.bfloat16)
    host = host_pool_for(device, 1 / 1024)
    assert host.size == (2**20 // per_token) // 4 * 4 and host.page_size == 4
    assert host.dtype == torch.bfloat16 and host.device.type == "cpu"
    with pytest.raises(ValueError, match="fewer than two pages"):
        host_pool_for(device, 1e-9)
    with pytest.raises(ValueError, match="of this machine's"):
        host_pool_for(device, 1e6)
    with pytest.raises(ValueError, match="write policy"):
        HiRadixCache(device, host, "write_sometimes")


# -- a random walk against the KV contents ----------------------------------------------
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=8)


@dataclass
class Running:
    seq: list[int]
    prefix: torch.Tensor
    node: object
    own: torch.Tensor


class HiRadixMachine(RuleBasedStateMachine):
    """Requests over a small device pool and a smaller host pool: every match's KV is
    the KV of its tokens, and both tiers' accounting holds after every rule."""

    DEVICE, HOST, PAGE, POLICY = 16, 16, 1, "write_back"

    def __init__(self) -> None:
        super().__init__()
        self.cache = cache_of(self.DEVICE, self.HOST, self.PAGE, self.POLICY)
        self.pool = self.cache.kv_pool
        self.running: list[Running] = []

    def seq_of(self, tokens: list[int]) -> list[int]:
        return [t for t in tokens for _ in range(self.PAGE)]

    @rule(tokens=TOKENS, load=st.booleans())
    def start_request(self, tokens: list[int], load: bool) -> None:
        seq = self.seq_of(tokens)
        hit = self.cache.match_prefix(seq, load=load)
        assert_kv(self.pool, seq, hit.indices)
        self.cache.inc_lock_ref(hit.node)
        need = len(seq) - hit.length
        short = need - self.pool.available()
        if short > 0:
            self.cache.evict(short)
        own = self.pool.alloc(need)
        if own is None:
            self.cache.dec_lock_ref(hit.node)
            return
        compute(self.pool, seq, hit.length, own)
        self.running.append(Running(seq, hit.indices, hit.node, own))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish_request(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        kv = torch.cat([req.prefix, req.own])
        cached = self.cache.insert(req.seq, kv)
        assert cached >= req.prefix.numel()
        self.pool.free(kv[req.prefix.numel() : cached])
        self.cache.dec_lock_ref(req.node)

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens: int) -> None:
        self.cache.evict(num_tokens)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        seq = self.seq_of(tokens)
        assert_kv(self.pool, seq, self.cache.match_prefix(seq).indices)

    @invariant()
    def accounting_holds(self) -> None:
        self.cache.check_invariants()
        sizes = self.cache.sizes()
        own = sum(r.own.numel() for r in self.running)
        total = self.pool.available() + sizes.evictable_tokens + sizes.protected_tokens + own
        assert total == self.pool.size


class PagedWriteThroughMachine(HiRadixMachine):
    DEVICE, HOST, PAGE, POLICY = 24, 16, 2, "write_through"


TestHiRadixMachine = HiRadixMachine.TestCase
TestHiRadixMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPagedWriteThroughMachine = PagedWriteThroughMachine.TestCase
TestPagedWriteThroughMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)


# -- the shared store (L3) ---------------------------------------------------------------
def store_for(root: Path, pool: KVPool, namespace: str = "m") -> FileBlockStore:
    shape = tuple(gather_rows(pool, torch.zeros(16, dtype=torch.int64)).shape)
    return FileBlockStore(root, namespace, shape)


def test_a_second_cache_loads_what_the_first_stored(tmp_path: Path) -> None:
    first = HiRadixCache(make_pool(64), make_pool(64), "write_through", None)
    first.store = store_for(tmp_path, first.kv_pool)
    seq = list(range(40))  # two whole blocks of 16, and 8 tokens that are no block
    first.insert(seq, fresh(seq, first.kv_pool))
    assert first.host_stats().store_written_tokens == 32
    second = HiRadixCache(make_pool(64), make_pool(64), "write_back", None)
    second.store = store_for(tmp_path, second.kv_pool)
    assert second.match_prefix(seq).length == 0  # without load: the tree alone
    hit = second.match_prefix(seq, load=True)
    assert hit.length == 32
    assert_kv(second.kv_pool, seq, hit.indices)
    assert second.host_stats().store_loaded_tokens == 32
    second.check_invariants()
    # Another namespace (another model) shares nothing.
    third = HiRadixCache(make_pool(64), make_pool(64))
    third.store = store_for(tmp_path, third.kv_pool, namespace="other")
    assert third.match_prefix(seq, load=True).length == 0


def test_the_store_continues_a_match_from_inside_a_block(tmp_path: Path) -> None:
    first = HiRadixCache(make_pool(64), make_pool(64), "write_through")
    first.store = store_for(tmp_path, first.kv_pool)
    seq = list(range(48))
    first.insert(seq, fresh(seq, first.kv_pool))
    second = HiRadixCache(make_pool(64), make_pool(64))
    second.store = store_for(tmp_path, second.kv_pool)
    second.insert(seq[:20], fresh(seq[:20], second.kv_pool))  # its own 20: into block 2
    hit = second.match_prefix(seq, load=True)
    assert hit.length == 48
    assert_kv(second.kv_pool, seq, hit.indices)
    assert second.host_stats().store_loaded_tokens == 28
    second.check_invariants()


def test_a_damaged_or_unwritable_store_is_a_miss(tmp_path: Path) -> None:
    pool = make_pool(64)
    store = store_for(tmp_path, pool)
    rows = gather_rows(pool, torch.arange(1, 17))
    assert store.write(7, rows) and store.contains(7)
    assert torch.equal(store.read(7), rows)  # type: ignore[arg-type]
    store._path(7).write_bytes(b"short")
    assert store.read(7) is None
    assert store.read(8) is None
    other = 0x2B << 56  # in another folder than block 7's
    store._path(other).parent.write_bytes(b"")  # a file where its folder goes: writes fail
    assert store.write(other, rows) is False
    assert not store.contains(other)


def test_kv_events_tell_the_tiers_apart() -> None:
    cache = cache_of(32, 64)
    log = BlockEventLog(4)
    cache.enable_events(log)
    seq = list(range(12))
    cache.insert(seq, fresh(seq, cache.kv_pool))
    (stored,) = log.drain()
    assert isinstance(stored, StoredBlocks)
    cache.evict(12)
    assert log.drain() == [OffloadedBlocks(stored.block_hashes)]
    snapshot = cache.snapshot_events()
    assert snapshot[-1] == OffloadedBlocks(stored.block_hashes)
    cache.match_prefix(seq, load=True)
    assert log.drain() == [RestoredBlocks(stored.block_hashes)]
    assert not any(isinstance(e, OffloadedBlocks) for e in cache.snapshot_events())
