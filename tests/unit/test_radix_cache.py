"""RadixCache and NaiveCache: hand-written cases, then state machines checked against a
brute-force reference (a dict from every cached token prefix to its slot)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.kvcache.radix_cache import RadixCache, TreeNode, common_prefix_len


def make_pool(num_slots: int, page_size: int = 1) -> KVPool:
    return KVPool(num_slots, 1, 1, 1, torch.float32, "cpu", page_size=page_size)


def put(cache: RadixCache, pool: KVPool, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots, freeing duplicates like the scheduler does."""
    slots = pool.alloc(len(key))
    assert slots is not None
    present = cache.insert(key, slots)
    pool.free(slots[:present])
    return slots


# -- hand-written cases ---------------------------------------------------------------
def test_match_after_insert() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    slots = put(cache, pool, [1, 2, 3])
    hit = cache.match_prefix([1, 2, 3, 4])
    assert hit.length == 3 and torch.equal(hit.indices, slots)
    for key in ([], [9], [2, 1]):
        miss = cache.match_prefix(key)
        assert miss.length == 0 and miss.indices.dtype == torch.int64
        assert miss.node is cache._root
    cache.check_invariants()


def test_partial_match_splits_node() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    slots = put(cache, pool, [1, 2, 3, 4])
    hit = cache.match_prefix([1, 2, 7])
    assert hit.length == 2 and torch.equal(hit.indices, slots[:2])
    assert hit.node.key == [1, 2] and [c.key for c in hit.node.children.values()] == [[3, 4]]
    new = pool.alloc(1)
    assert new is not None
    assert cache.insert([1, 2, 7], torch.cat([slots[:2], new])) == 2
    assert sorted(len(n.key) for n in cache._nodes()) == [1, 2, 2]
    cache.check_invariants()


def test_insert_returns_already_cached_length() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    first = pool.alloc(3)
    assert first is not None
    assert cache.insert([1, 2, 3], first) == 0
    extra = pool.alloc(1)
    assert extra is not None
    longer = torch.cat([first, extra])
    assert cache.insert([1, 2, 3, 4], longer) == 3
    assert cache.insert([1, 2], first[:2]) == 2
    assert cache.total_size() == 4 and cache.sizes().evictable_tokens == 4
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, longer)


def test_evicts_least_recently_used_leaf_first() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    a = put(cache, pool, [1, 1])
    b = put(cache, pool, [2, 2])
    c = put(cache, pool, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent
    freed_order = []
    for _ in range(3):
        before = list(pool.free_slot_ids())
        assert cache.evict(1) == 2  # whole leaves go at once
        freed_order.append(pool.free_slot_ids()[len(before) :])
    assert freed_order == [b.tolist(), c.tolist(), a.tolist()]
    assert cache.evict(5) == 0 and pool.available() == pool.size
    cache.check_invariants()


def test_evict_frees_parent_once_it_becomes_a_leaf() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    put(cache, pool, [1, 2, 3])
    put(cache, pool, [1, 2, 4])  # splits into [1 2] -> {[3], [4]}
    put(cache, pool, [5])
    cache.match_prefix([5])
    assert cache.evict(3) == 4  # [3], [4], then their parent [1 2]; [5] is newest
    assert cache.match_prefix([5]).length == 1 and cache.total_size() == 1
    cache.check_invariants()


def test_stale_candidates_are_dropped_and_never_pile_up() -> None:
    """Every touch, lock and unlock pushes a fresh eviction candidate; the stale ones are
    skipped when they surface and the heap is rebuilt before it outgrows the tree."""
    pool = make_pool(64)
    cache = RadixCache(pool)
    old = put(cache, pool, [1, 1])
    new = put(cache, pool, [2, 2])
    for _ in range(500):  # [2 2] touched and locked over and over: one stale entry each
        hit = cache.match_prefix([2, 2])
        cache.inc_lock_ref(hit.node)
        cache.dec_lock_ref(hit.node)
    # Two leaves in the tree: the candidates' heap (private) stays within its bound.
    assert len(cache._candidates) <= 2 * 2 + 64
    cache.check_invariants()
    before = len(pool.free_slot_ids())
    assert cache.evict(1) == 2 and pool.free_slot_ids()[before:] == old.tolist()
    hit = cache.match_prefix([2, 2])
    cache.inc_lock_ref(hit.node)
    assert cache.evict(2) == 0  # the one leaf left is locked: its entries are all stale
    cache.dec_lock_ref(hit.node)
    assert cache.evict(2) == 2 and pool.free_slot_ids()[-2:] == new.tolist()
    cache.check_invariants()


def test_locked_nodes_are_never_evicted_and_counters_move() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [1, 2, 5, 6])
    first = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(first.node)
    assert (cache.sizes().protected_tokens, cache.sizes().evictable_tokens) == (4, 2)
    second = cache.match_prefix([1, 2, 5, 6])
    cache.inc_lock_ref(second.node)
    cache.inc_lock_ref(second.node)
    assert (cache.sizes().protected_tokens, cache.sizes().evictable_tokens) == (6, 0)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(second.node)
    cache.dec_lock_ref(second.node)
    cache.check_invariants()
    assert cache.evict(100) == 2  # only [5 6]; [1 2 3 4] is still locked
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, first.indices)
    cache.dec_lock_ref(first.node)
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(first.node)
    assert cache.sizes().protected_tokens == 0 and cache.evict(3) == 4  # leaf, then parent
    with pytest.raises(RuntimeError, match="stale"):
        cache.inc_lock_ref(first.node)  # evicted handle
    cache.check_invariants()


def test_reset_and_root_locks() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    put(cache, pool, [1, 2])
    locked = cache.match_prefix([1, 2])
    cache.inc_lock_ref(locked.node)
    with pytest.raises(RuntimeError, match="locks"):
        cache.reset()
    cache.dec_lock_ref(locked.node)
    root = cache.match_prefix([]).node
    cache.inc_lock_ref(root)
    with pytest.raises(RuntimeError, match="locks"):
        cache.reset()
    cache.dec_lock_ref(root)
    with pytest.raises(RuntimeError, match="root"):
        cache.dec_lock_ref(root)
    cache.reset()
    pool.clear()  # reset leaves the pool to its owner
    assert cache.total_size() == 0 and cache.match_prefix([1, 2]).length == 0
    with pytest.raises(RuntimeError, match="stale"):
        cache.inc_lock_ref(locked.node)
    cache.check_invariants()


def test_bad_input_is_rejected() -> None:
    pool = make_pool(8)
    cache = RadixCache(pool)
    with pytest.raises(ValueError, match="tokens"):
        cache.insert([1, 2], torch.tensor([1]))
    with pytest.raises(ValueError, match="int64"):
        cache.insert([1], torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match=">= 0"):
        cache.evict(-1)
    with pytest.raises(TypeError):
        cache.inc_lock_ref("not a node")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(pool, page_size=2)


def test_pages_match_and_insert_whole_pages_only() -> None:
    pool = make_pool(16, page_size=2)
    cache = RadixCache(pool, page_size=2)
    slots = put(cache, pool, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3]).length == 2  # the partial page never matches
    assert cache.match_prefix([1, 2, 3, 5]).length == 2
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5]).indices, slots)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))
    put(cache, pool, [1, 2, 9, 9])
    assert sorted(n.key for n in cache._nodes()) == [[1, 2], [3, 4], [9, 9]]
    cache.check_invariants()


def test_naive_cache_keeps_nothing() -> None:
    pool = make_pool(8)
    cache = NaiveCache(pool)
    hit = cache.match_prefix([1, 2, 3])
    assert hit.length == 0 and not cache.reuses_prefixes
    cache.inc_lock_ref(hit.node)
    slots = pool.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 3
    pool.free(slots[hit.length : 3])  # the scheduler's duplicate-free returns them all
    cache.dec_lock_ref(hit.node)
    assert pool.available() == pool.size and cache.evict(10) == 0
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(hit.node)
    with pytest.raises(TypeError):
        cache.inc_lock_ref(object())


# -- state machines -------------------------------------------------------------------
TOKENS = st.integers(0, 2)  # a small alphabet, so prefixes are shared
PAGE_CODES = st.integers(0, 8)  # one page each, see RadixMachine.pages


@dataclass
class Request:
    seq: list[int]
    prefix: torch.Tensor  # slots owned by the cache, locked through `node`
    node: object
    own: torch.Tensor  # slots this request owns outside the cache (in flight)


class RadixMachine(RuleBasedStateMachine):
    POOL_SIZE = 32
    PAGE = 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(self.POOL_SIZE, self.PAGE)
        self.cache = RadixCache(self.pool, self.PAGE)
        # Every cached page-aligned prefix -> the slots of its last page.
        self.ref: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.atime: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.locks: Counter[tuple[int, ...]] = Counter()  # locked handle -> count
        self.running: list[Request] = []
        self.held: list[tuple[tuple[int, ...], object]] = []

    # reference model
    def prefixes(self, seq: list[int] | tuple[int, ...], k: int) -> list[tuple[int, ...]]:
        """The page-aligned prefixes of seq[:k], shortest first."""
        return [tuple(seq[:j]) for j in range(self.PAGE, k + 1, self.PAGE)]

    def ref_longest(self, seq: list[int]) -> int:
        k = 0
        while k + self.PAGE <= len(seq) and tuple(seq[: k + self.PAGE]) in self.ref:
            k += self.PAGE
        return k

    def touch(self, seq: list[int], k: int) -> None:
        self.clock += 1
        for p in self.prefixes(seq, k):
            self.atime[p] = self.clock

    def locked(self) -> set[tuple[int, ...]]:
        return {p for h, n in self.locks.items() if n for p in self.prefixes(h, len(h))}

    def eviction_order(self) -> list[tuple[int, ...]]:
        """Unlocked pages in the order LRU-over-leaves would remove them."""
        left, locked, order = set(self.ref), self.locked(), []
        while True:
            parents = {p[: -self.PAGE] for p in left}
            leaves = [p for p in left if p not in parents and p not in locked]
            if not leaves:
                return order
            oldest = min(leaves, key=lambda p: (self.atime[p], -len(p)))
            order.append(oldest)
            left.remove(oldest)

    def match(self, seq: list[int]) -> tuple[int, object, torch.Tensor]:
        hit = self.cache.match_prefix(seq)
        k = self.ref_longest(seq)
        assert hit.length == k
        assert hit.indices.tolist() == [s for p in self.prefixes(seq, k) for s in self.ref[p]]
        self.touch(seq, k)
        return k, hit.node, hit.indices

    def evict_and_check(self, num_tokens: int) -> None:
        order = self.eviction_order()
        mark = len(self.pool.free_slot_ids())
        freed = self.cache.evict(num_tokens)
        assert freed >= min(num_tokens, len(order) * self.PAGE) and freed % self.PAGE == 0
        freed_slots = self.pool.free_slot_ids()[mark:]
        assert len(freed_slots) == freed
        gone = order[: freed // self.PAGE]
        assert sorted(freed_slots) == sorted(s for p in gone for s in self.ref[p])
        for p in gone:
            del self.ref[p], self.atime[p]

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.pool.available():
            self.evict_and_check(n - self.pool.available())
        return self.pool.alloc(n)

    def pages(self, codes: list[int]) -> list[int]:
        """Whole pages of tokens in {0, 1, 2}; with PAGE 2, pages [1, 0] and [1, 2] share
        their first token, so matches that diverge mid-page are common."""
        if self.PAGE == 1:
            return [c % 3 for c in codes]
        assert self.PAGE == 2
        return [t for c in codes for t in (c // 3 % 3, c % 3)]

    # rules
    @rule(tokens=st.lists(PAGE_CODES, min_size=1, max_size=6))
    def start_request(self, tokens: list[int]) -> None:
        seq = self.pages(tokens)
        k, node, prefix = self.match(seq)
        self.cache.inc_lock_ref(node)
        self.locks[tuple(seq[:k])] += 1
        own = self.alloc(len(seq) - k)
        if own is None:  # not enough memory even after eviction: back off
            self.cache.dec_lock_ref(node)
            self.locks[tuple(seq[:k])] -= 1
            return
        self.running.append(Request(seq, prefix, node, own))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), tokens=st.lists(PAGE_CODES, min_size=1, max_size=3))
    def extend_request(self, i: int, tokens: list[int]) -> None:
        req = self.running[i % len(self.running)]
        more = self.pages(tokens)
        slots = self.alloc(len(more))
        if slots is not None:
            req.seq = req.seq + more
            req.own = torch.cat([req.own, slots])

    def cache_request(self, req: Request) -> None:
        """insert + free duplicates, exactly as the scheduler does."""
        kv = torch.cat([req.prefix, req.own])
        prefix_len = req.prefix.numel()
        expected = self.ref_longest(req.seq)
        new_prefix_len = self.cache.insert(req.seq, kv)
        assert new_prefix_len == expected >= prefix_len
        self.pool.free(kv[prefix_len:new_prefix_len])
        for j in range(new_prefix_len, len(req.seq), self.PAGE):
            self.ref[tuple(req.seq[: j + self.PAGE])] = tuple(kv[j : j + self.PAGE].tolist())
        self.touch(req.seq, len(req.seq))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish_request(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        self.cache_request(req)
        self.cache.dec_lock_ref(req.node)
        self.locks[tuple(req.seq[: req.prefix.numel()])] -= 1

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def cache_unfinished(self, i: int) -> None:
        """Chunked prefill: cache what is computed and move the lock onto it."""
        req = self.running[i % len(self.running)]
        old_handle = tuple(req.seq[: req.prefix.numel()])
        self.cache_request(req)
        k, node, prefix = self.match(req.seq)
        assert k == len(req.seq)
        self.cache.dec_lock_ref(req.node)
        self.cache.inc_lock_ref(node)
        self.locks[old_handle] -= 1
        self.locks[tuple(req.seq)] += 1
        req.prefix, req.node, req.own = prefix, node, req.own[:0]

    @rule(
        tokens=st.lists(PAGE_CODES, max_size=6),
        tail=st.lists(TOKENS, max_size=1),
        lock=st.booleans(),
    )
    def match_and_maybe_lock(self, tokens: list[int], tail: list[int], lock: bool) -> None:
        seq = self.pages(tokens) + tail  # a partial last page must not match
        k, node, _ = self.match(seq)
        handle = tuple(seq[:k])
        if lock:
            self.cache.inc_lock_ref(node)
            self.locks[handle] += 1
            self.held.append((handle, node))
        elif k and not any(h[:k] == handle for h, n in self.locks.items() if n):
            with pytest.raises(RuntimeError, match="unlocked"):
                self.cache.dec_lock_ref(node)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def unlock(self, i: int) -> None:
        handle, node = self.held.pop(i % len(self.held))
        self.cache.dec_lock_ref(node)
        self.locks[handle] -= 1

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens: int) -> None:
        self.evict_and_check(num_tokens)

    @precondition(lambda self: not self.running and not self.held)
    @rule()
    def flush(self) -> None:
        self.cache.reset()
        self.pool.clear()
        self.ref.clear()
        self.atime.clear()

    # invariants
    @invariant()
    def accounting_holds(self) -> None:
        self.cache.check_invariants()
        locked = self.locked()
        assert locked <= set(self.ref)
        sizes = self.cache.sizes()
        assert (sizes.protected_tokens, sizes.evictable_tokens) == (
            len(locked) * self.PAGE,
            (len(self.ref) - len(locked)) * self.PAGE,
        )
        in_flight = [s for r in self.running for s in r.own.tolist()]
        free = self.pool.free_slot_ids()
        total = len(free) + sizes.evictable_tokens + sizes.protected_tokens + len(in_flight)
        assert total == self.pool.size
        # Every slot is free XOR cached XOR held by a request; none twice.
        owned = [*free, *(s for page in self.ref.values() for s in page), *in_flight]
        assert sorted(owned) == list(range(self.PAGE, self.pool.size + self.PAGE))

    @invariant()
    def tree_matches_reference(self) -> None:
        """Walk the tree (read-only: no LRU touch) and compare page by page."""
        contents: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(self.cache._root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                slots = child.value.tolist()
                for j in range(self.PAGE, len(child.key) + 1, self.PAGE):
                    page = tuple(slots[j - self.PAGE : j])
                    contents[(*path, *child.key[:j])] = (page, child.lock_ref)
                stack.append((child, (*path, *child.key)))
        assert {p: s for p, (s, _) in contents.items()} == self.ref
        for p, (_, lock_ref) in contents.items():
            assert lock_ref == sum(n for h, n in self.locks.items() if h[: len(p)] == p)


class PagedRadixMachine(RadixMachine):
    POOL_SIZE = 24
    PAGE = 2


class NaiveMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(16)
        self.cache = NaiveCache(self.pool)
        self.running: list[tuple[list[int], object, torch.Tensor]] = []

    @rule(seq=st.lists(TOKENS, min_size=1, max_size=8))
    def start_request(self, seq: list[int]) -> None:
        hit = self.cache.match_prefix(seq)
        assert hit.length == 0 and hit.indices.numel() == 0
        slots = self.pool.alloc(len(seq))
        if slots is not None:
            self.cache.inc_lock_ref(hit.node)
            self.running.append((seq, hit.node, slots))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish_request(self, i: int) -> None:
        seq, node, slots = self.running.pop(i % len(self.running))
        new_prefix_len = self.cache.insert(seq, slots)
        assert new_prefix_len == len(seq)
        self.pool.free(slots[0:new_prefix_len])
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens: int) -> None:
        assert self.cache.evict(num_tokens) == 0

    @invariant()
    def accounting_holds(self) -> None:
        self.cache.check_invariants()
        sizes = self.cache.sizes()
        assert sizes.evictable_tokens == sizes.protected_tokens == 0
        in_flight = [s for _, _, slots in self.running for s in slots.tolist()]
        owned = [*self.pool.free_slot_ids(), *in_flight]
        assert sorted(owned) == list(range(1, self.pool.size + 1))


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = _settings
TestPagedRadixMachine = PagedRadixMachine.TestCase
TestPagedRadixMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestNaiveMachine = NaiveMachine.TestCase
TestNaiveMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


@given(
    st.lists(st.integers(0, 3), max_size=300),
    st.lists(st.integers(0, 3), max_size=300),
    st.integers(0, 300),
)
def test_common_prefix_len_matches_a_token_by_token_scan(
    a: list[int], b: list[int], cut: int
) -> None:
    # Long shared runs (b starts with a's first `cut` tokens) cross the block compares.
    b = a[:cut] + b
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix_len(a, b) == expected
    assert common_prefix_len(a, tuple(b)) == expected
