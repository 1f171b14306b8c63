"""page_size > 1: the page allocator against a set model, the KV manager's page layout and
its slot predictions, and engine outputs equal to page_size 1 under chunking and retraction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.config import EngineConfig
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.request import Req
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sched.kv_manager import KVManager
from radixserve.engine.sched.prefill import IN_BATCH_SHARE_MIN, AddResult, PrefillAdder
from tests.unit.engine_helpers import engine_outputs, greedy_params, make_prompts


def make_pool(num_slots: int, page_size: int, debug: bool = False) -> KVPool:
    return KVPool(num_slots, 1, 1, 1, torch.float32, "cpu", page_size=page_size, debug=debug)


# -- the pool ---------------------------------------------------------------------------
def test_pool_hands_out_whole_aligned_pages_never_page_zero() -> None:
    pool = make_pool(70, page_size=16)  # rounded down to whole pages
    assert (pool.size, pool.num_pages, pool.available()) == (64, 4, 64)
    slots = pool.alloc(32)
    assert slots is not None and slots.dtype == torch.int64
    pages = slots.view(2, 16)
    assert bool((pages[:, 0] % 16 == 0).all()) and int(slots.min()) >= 16  # page 0 is reserved
    assert torch.equal(pages - pages[:, :1], torch.arange(16).expand(2, 16))
    rest = pool.alloc(32)
    assert rest is not None and pool.alloc(16) is None and pool.available() == 0
    assert sorted(torch.cat([slots, rest]).tolist()) == list(range(16, 80))
    with pytest.raises(ValueError, match="whole number of pages"):
        pool.alloc(5)


def test_pool_free_frees_whole_pages_once() -> None:
    pool = make_pool(32, page_size=4, debug=True)  # the checks read the device: debug only
    slots = pool.alloc(12)
    assert slots is not None
    pool.free(slots[4:6])  # part of the second page frees that page
    assert pool.available() == 32 - 8
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(slots[6:8])
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(torch.cat([slots[0:1], slots[8:9], slots[1:2]]))  # one page, not adjacent
    with pytest.raises(RuntimeError, match="not allocatable"):
        pool.free(torch.tensor([0, 1], dtype=torch.int64))  # the reserved page
    with pytest.raises(RuntimeError, match="page order"):
        pool.free(torch.cat([slots[2:4], slots[8:10]]))  # two pages in one page entry
    assert pool.available() == 32 - 8  # failed calls changed nothing
    pool.free(slots[0:3])  # a partial last page is freed whole
    pool.free(slots[8:12])
    assert pool.available() == 32 and sorted(pool.free_slot_ids()) == list(range(4, 36))


def test_page_size_one_is_slot_granular() -> None:
    pool = make_pool(8, page_size=1)
    slots = pool.alloc(3)
    assert slots is not None and slots.tolist() == [1, 2, 3]
    pool.free(slots[1:2])
    assert pool.available() == 6 and pool.free_slot_ids()[-1] == 2


def test_config_accepts_pages() -> None:
    assert EngineConfig(page_size=16).page_size == 16
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)


# -- the KV manager ---------------------------------------------------------------------
def _req(ids: list[int]) -> Req:
    return Req(
        rid="r", origin_input_ids=ids, params=SamplingParams(), seed=0, stop_token_ids=frozenset()
    )


def _manager(page_size: int, radix: bool) -> KVManager:
    pool = make_pool(64, page_size)
    cache: PrefixCache = RadixCache(pool) if radix else NaiveCache(pool)
    return KVManager(pool, ReqToTokenPool(2, 64, "cpu"), cache)


@pytest.mark.parametrize("radix", [True, False])
def test_manager_fills_pages_in_order_and_predicts_its_slots(radix: bool) -> None:
    kv = _manager(page_size=4, radix=radix)
    req = _req(list(range(100, 130)))
    assert kv.match(req) == 0
    kv.admit(req)
    for n in [6, 1, 1, 3, 2, 8]:  # crosses page ends mid-extend, fills tails exactly
        predicted = kv.slots_needed(req, n)
        before = kv.kv_pool.available()
        kv.assign_new_slots(req, n)
        assert before - kv.kv_pool.available() == predicted
        req.kv_len += n  # as the scheduler does once the forward ran
        assert kv.owned_tokens(req) == -(-req.kv_len // 4) * 4
        kv.check_invariants([req])  # includes the layout: position i at offset i % 4
    assert req.kv_len == 21 and kv.kv_pool.available() == 64 - 24
    kv.release(req)
    # The 20 tokens of whole pages stay cached (radix) or come back; the partial page is freed.
    assert kv.cache.sizes().evictable_tokens == (20 if radix else 0)
    assert kv.kv_pool.available() == (44 if radix else 64)
    kv.check_invariants([])
    again = _req(list(range(100, 130)))
    assert kv.match(again) == (20 if radix else 0)


def test_manager_unassign_keeps_the_tail_of_the_last_page() -> None:
    kv = _manager(page_size=4, radix=True)
    req = _req(list(range(100, 110)))
    kv.match(req)
    kv.admit(req)
    kv.assign_new_slots(req, 6)
    req.kv_len = 6
    free = kv.kv_pool.available()
    kv.assign_new_slots(req, 1)  # the tail of page 2: nothing allocated, nothing to free
    kv.unassign_new_slots(req, 1)
    assert kv.kv_pool.available() == free
    kv.assign_new_slots(req, 3)  # two tail slots, then a new page
    kv.unassign_new_slots(req, 3)
    assert kv.kv_pool.available() == free
    kv.check_invariants([req])


def _adder(kv: KVManager, rem_kv: int, rem_chunk_tokens: int = -1) -> PrefillAdder:
    return PrefillAdder(
        kv=kv,
        reserved_tokens=kv.available_tokens() - rem_kv,  # leaves exactly rem_kv to prefill
        rem_input_tokens=1000,
        rem_chunk_tokens=rem_chunk_tokens,
        new_token_ratio=0.0,  # no future-token estimate: the budget is the pages alone
        max_running=8,
        num_running=1,
    )


def test_prefill_budget_counts_whole_pages() -> None:
    kv = _manager(page_size=16, radix=True)
    req = _req(list(range(100, 120)))  # 20 tokens take two pages
    assert _adder(kv, rem_kv=24).add_one(req) is AddResult.NO_TOKENS
    assert req.req_pool_idx is None and kv.kv_pool.available() == 64
    # Two pages for the prompt plus one reserved for its first decode step.
    assert _adder(kv, rem_kv=40).add_one(req) is AddResult.NO_TOKENS
    adder = _adder(kv, rem_kv=48)
    assert adder.add_one(req) is AddResult.ADDED and adder.admitted == [req]
    assert kv.kv_pool.available() == 32


def test_chunk_budget_uses_the_tail_then_whole_pages() -> None:
    kv = _manager(page_size=16, radix=True)
    req = _req(list(range(100, 160)))
    first = _adder(kv, rem_kv=64, rem_chunk_tokens=20)
    assert first.add_one(req) is AddResult.ADDED and first.chunked is req
    req.kv_len, req.extend_len = 20, 0  # the forward ran
    kv.cache_unfinished(req)  # one whole page cached, the partial one stays the request's
    assert kv.owned_tokens(req) == 16 and kv.cache.sizes().protected_tokens == 16
    free = kv.kv_pool.available()
    second = _adder(kv, rem_kv=20)
    second.add_chunked(req)
    # 12 tokens fill the tail of its page for free, then one more page of 16.
    assert req.extend_len == 28 and second.chunked is req
    assert free - kv.kv_pool.available() == 16
    req.kv_len, req.extend_len = 48, 0
    kv.check_invariants([req])


def test_in_batch_sharing_compares_the_whole_head_not_just_the_uncached_window() -> None:
    # Two cached prompts of one length, A and C; a request over A admitted this step
    # computes the 40 tokens X past A. Another over A + X waits for it to be cached; one
    # over C + X matches X at the same positions but not A, so it shares nothing.
    pool = make_pool(1024, 1)
    kv = KVManager(pool, ReqToTokenPool(8, 256, "cpu"), RadixCache(pool))
    heads = {"A": list(range(100, 116)), "C": list(range(200, 216))}
    for head in heads.values():
        cached = _req(head)
        assert _adder(kv, rem_kv=512).add_one(cached) is AddResult.ADDED
        cached.kv_len, cached.extend_len = len(head), 0
        kv.cache_unfinished(cached)
    x = list(range(300, 300 + IN_BATCH_SHARE_MIN + 8))
    adder = _adder(kv, rem_kv=512)
    first = _req(heads["A"] + x + [1])
    assert adder.add_one(first) is AddResult.ADDED
    assert adder.add_one(_req(heads["A"] + x + [2, 3])) is AddResult.DEFERRED
    assert adder.add_one(_req(heads["C"] + x + [4])) is AddResult.ADDED


# -- the engine -------------------------------------------------------------------------
MAX_NEW = 24
LENGTHS = [5, 17, 40, 3, 64, 90, 33, 12]


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )


def _prompts(vocab_size: int) -> list[list[int]]:
    prompts = make_prompts(vocab_size, LENGTHS, seed=3)
    return prompts + [prompts[4][:50] + p for p in prompts[:3]]


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Path) -> list[list[int]]:
    engine = _engine(tiny_llama_dir, chunked_prefill_size=-1)
    return engine_outputs(engine, _prompts(engine.runner.vocab_size), MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["radix", "no-radix"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_outputs_equal_page_size_one_under_retraction(
    tiny_llama_dir: Path, baseline: list[list[int]], page_size: int, disable_radix_cache: bool
) -> None:
    # 192 slots: the longest request (90 + 24) fits alone, all of them at once do not.
    engine = _engine(
        tiny_llama_dir,
        page_size=page_size,
        max_total_tokens=200,
        chunked_prefill_size=16,  # prompts of 17, 33, 40, 90 ... end mid-page and mid-chunk
        disable_radix_cache=disable_radix_cache,
    )
    assert engine.runner.kv_pool.page_size == page_size
    outs = engine_outputs(engine, _prompts(engine.runner.vocab_size), MAX_NEW)
    assert engine.scheduler.total_retractions > 0, "the pool was meant to force retraction"
    assert outs == baseline
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size


@pytest.mark.slow
def test_shared_prefix_reuses_whole_pages(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, page_size=16)
    prefix, tail_a, tail_b = make_prompts(engine.runner.vocab_size, [500, 20, 30], seed=7)
    engine.generate(input_ids=prefix + tail_a, sampling_params=greedy_params(8))
    before = engine.scheduler.total_prefill_tokens
    second = engine.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(8))
    assert isinstance(second, dict)
    cached = second["meta_info"]["cached_tokens"]
    # The page holding tokens 496..511 mixes the prefix with tail_a: it cannot match.
    assert cached == 496
    assert engine.scheduler.total_prefill_tokens - before == len(prefix + tail_b) - cached
    plain = _engine(tiny_llama_dir, disable_radix_cache=True)
    again = plain.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(8))
    assert isinstance(again, dict) and again["output_ids"] == second["output_ids"]
