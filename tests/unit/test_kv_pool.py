"""The KV pool's device free list against a Python list model (hand-out order included),
its debug checks, and no leaked page after a randomized workload through the Engine."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve import Engine
from radixserve.engine.kvcache.pool import KVPool
from tests.unit.engine_helpers import make_prompts

NUM_PAGES = 40


class PoolMachine(RuleBasedStateMachine):
    """Allocations and frees in runs a request's row would hold (partial last pages
    included); the model is the free list as a Python list: take from the front,
    append freed pages at the back."""

    PAGE = 1
    DEBUG = False

    def __init__(self) -> None:
        super().__init__()
        page = self.PAGE
        self.pool = KVPool(
            NUM_PAGES * page, 1, 1, 1, torch.float32, "cpu", page_size=page, debug=self.DEBUG
        )
        self.free: list[int] = list(range(1, NUM_PAGES + 1))
        self.held: list[list[int]] = []  # the pages of each allocation, in hand-out order

    @rule(num_pages=st.integers(0, 9))
    def alloc(self, num_pages: int) -> None:
        slots = self.pool.alloc(num_pages * self.PAGE)
        if num_pages > len(self.free):
            assert slots is None
            return
        assert slots is not None and slots.dtype == torch.int64
        taken, self.free = self.free[:num_pages], self.free[num_pages:]
        expected = [p * self.PAGE + i for p in taken for i in range(self.PAGE)]
        assert slots.tolist() == expected
        if taken:
            self.held.append(taken)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_runs(self, data: st.DataObject) -> None:
        """Free one allocation in runs cut at page boundaries, each run ending anywhere
        in its last page (a partial last page frees the page)."""
        pages = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        cuts = data.draw(st.sets(st.integers(1, len(pages) - 1))) if len(pages) > 1 else set()
        bounds = [0, *sorted(cuts), len(pages)]
        for lo, hi in itertools.pairwise(bounds):
            slots = [p * self.PAGE + i for p in pages[lo:hi] for i in range(self.PAGE)]
            keep = len(slots) - data.draw(st.integers(0, self.PAGE - 1))
            self.pool.free(torch.tensor(slots[:keep], dtype=torch.int64))
            self.free.extend(pages[lo:hi])

    @precondition(lambda self: self.DEBUG and len(self.free) > 0)
    @rule(data=st.data())
    def double_free_is_caught(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.free))
        offset = data.draw(st.integers(0, self.PAGE - 1))
        with pytest.raises(RuntimeError, match="freed twice"):
            self.pool.free(torch.tensor([page * self.PAGE + offset], dtype=torch.int64))

    @invariant()
    def free_list_matches_the_model(self) -> None:
        on_device = self.pool.free_page_ids()
        # The host count needs no device read; it must equal the device list's length.
        assert self.pool.available_pages() == len(on_device) == len(self.free)
        assert self.pool.available() == len(self.free) * self.PAGE
        assert on_device == self.free

    @invariant()
    def released_blocks_stay_few(self) -> None:
        assert len(self.pool._released) <= NUM_PAGES.bit_length() + 1


class PagedPoolMachine(PoolMachine):
    PAGE = 16


class DebugPoolMachine(PoolMachine):
    DEBUG = True


class DebugPagedPoolMachine(PoolMachine):
    PAGE = 16
    DEBUG = True


_settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestPagedPoolMachine = PagedPoolMachine.TestCase
TestDebugPoolMachine = DebugPoolMachine.TestCase
TestDebugPagedPoolMachine = DebugPagedPoolMachine.TestCase
TestPoolMachine.settings = TestPagedPoolMachine.settings = _settings
TestDebugPoolMachine.settings = TestDebugPagedPoolMachine.settings = _settings


def test_a_large_pool_keeps_its_free_list_on_the_device() -> None:
    """Nothing on the host grows with the pool: 20M free slots are one device tensor."""
    size = 20_000_000
    pool = KVPool(size, 0, 1, 1, torch.float32, "cpu", page_size=1)
    slots = pool.alloc(3)
    assert slots is not None and slots.tolist() == [1, 2, 3]
    pool.free(slots[1:])
    assert pool.available() == size - 1
    rest = pool.alloc(size - 3)  # the untouched tail, then the freed slots in order
    assert rest is not None and rest[[0, -1]].tolist() == [4, size]
    again = pool.alloc(2)
    assert again is not None and again.tolist() == [2, 3] and pool.alloc(1) is None


# -- the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_no_page_leaks_after_a_random_workload(tiny_llama_dir: Path, page_size: int) -> None:
    """Shared prefixes, a pool small enough to evict (and at page size 1 to retract),
    chunked prefill and aborts; afterwards every page is free or evictable, and evicting
    the cache gives back all of them."""
    engine = Engine(
        model_path=str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,  # page owners checked after every step
        page_size=page_size,
        max_total_tokens=128,
        chunked_prefill_size=32,
        init_new_token_ratio=0.0,  # admit optimistically: decoding runs short of pages
        min_new_token_ratio=0.0,
    )
    rng = random.Random(page_size)
    vocab = engine.runner.vocab_size
    stems = make_prompts(vocab, [20, 40], seed=11)
    tails = make_prompts(vocab, [rng.randint(1, 30) for _ in range(8)], seed=12)
    live: list[str] = []
    for i, tail in enumerate(tails):
        params = {"max_new_tokens": rng.randint(4, 20), "temperature": 0.0, "ignore_eos": True}
        live.append(engine.submit(stems[i % 2] + tail, params))
        if i % 3 == 2:
            engine.step()
        if i % 4 == 3:
            engine.abort(live[rng.randrange(len(live))])
    for _ in range(1000):
        engine.step()
        if not engine.has_work():
            break
    assert not engine.has_work()
    pool = engine.runner.kv_pool
    usage = engine.scheduler.usage()
    assert usage.protected_tokens == usage.in_flight_tokens == 0
    assert usage.free_tokens + usage.evictable_tokens == pool.size
    assert pool.available_pages() == len(pool.free_page_ids())
    assert engine.scheduler.kv.cache.evict(pool.size) == usage.evictable_tokens
    assert sorted(pool.free_page_ids()) == list(range(1, pool.num_pages + 1))
