"""Prefix reuse, abort and the KV accounting around them."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine.request import ReqStatus
from radixserve.engine.sched.prefill import IN_BATCH_SHARE_MIN
from tests.unit.engine_helpers import engine_outputs, greedy_params, make_prompts


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )


@pytest.mark.slow
def test_shared_prefix_is_reused(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    prefix, tail_a, tail_b = make_prompts(engine.runner.vocab_size, [500, 20, 30], seed=7)
    first = engine.generate(input_ids=prefix + tail_a, sampling_params=greedy_params(8))
    assert isinstance(first, dict) and first["meta_info"]["cached_tokens"] == 0
    before = engine.scheduler.total_prefill_tokens
    second = engine.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(8))
    assert isinstance(second, dict)
    cached = second["meta_info"]["cached_tokens"]
    assert cached >= 499
    # Only the uncached rest went through prefill (decode steps are not prefill tokens).
    assert engine.scheduler.total_prefill_tokens - before == len(prefix + tail_b) - cached
    # And the reuse does not change the answer.
    fresh = _engine(tiny_llama_dir, disable_radix_cache=True)
    again = fresh.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(8))
    assert isinstance(again, dict)
    assert again["output_ids"] == second["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow
def test_abort_half_of_in_flight(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, max_running_requests=64, chunked_prefill_size=256)
    prompts = make_prompts(
        engine.runner.vocab_size, [8 + (i * 7) % 40 for i in range(100)], seed=11
    )
    rids = [engine.submit(p, greedy_params(12)) for p in prompts]
    finals = {}
    for _ in range(4):  # some are running, some mid-prefill, some still waiting
        engine.step()
    states = {engine._groups[rid].choices[0].status for rid in rids[::2]}
    assert ReqStatus.RUNNING in states and ReqStatus.WAITING in states
    for rid in rids[::2]:
        assert engine.abort(rid)
    engine.scheduler.check_invariants()
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                assert out.rid not in finals, "a request finished twice"
                finals[out.rid] = out.req
    assert sorted(finals) == sorted(rids) and engine.num_tracked() == 0
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size
    for rid in rids[::2]:
        reason = finals[rid].finish_reason
        assert reason is not None and reason.kind == "abort"
    survivors = [finals[rid].output_ids for rid in rids[1::2]]
    reference = engine_outputs(_engine(tiny_llama_dir), prompts[1::2], 12)
    assert survivors == reference


def test_flush_cache(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    (ids,) = make_prompts(engine.runner.vocab_size, [40], seed=5)
    engine.generate(input_ids=ids, sampling_params=greedy_params(4))
    assert engine.scheduler.usage().evictable_tokens > 0
    assert engine.flush_cache()
    assert engine.scheduler.usage().free_tokens == engine.runner.kv_pool.size
    out = engine.generate(input_ids=ids, sampling_params=greedy_params(4))
    assert isinstance(out, dict) and out["meta_info"]["cached_tokens"] == 0


def test_prefix_is_shared_while_its_first_request_decodes(tiny_llama_dir: Path) -> None:
    """The prompt's KV enters the cache when its prefill completes, so a request that
    arrives while the first one still decodes reuses it (and gets the same tokens)."""
    engine = _engine(tiny_llama_dir)
    prefix, tail_a, tail_b = make_prompts(engine.runner.vocab_size, [300, 10, 12], seed=3)
    first = engine.submit(prefix + tail_a, greedy_params(16))
    engine.step()  # A's whole prompt in one prefill; A now decodes
    assert engine._groups[first].choices[0].status is ReqStatus.RUNNING
    second = engine.submit(prefix + tail_b, greedy_params(8))
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out.req
    assert finals[second].cached_tokens >= len(prefix)
    assert engine.num_tracked() == 0
    usage = engine.scheduler.usage()
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size
    reference = engine_outputs(
        _engine(tiny_llama_dir, disable_radix_cache=True), [prefix + tail_b], 8
    )
    assert finals[second].output_ids == reference[0]


@pytest.mark.slow
def test_one_batch_of_one_prefix_keeps_one_copy(tiny_llama_dir: Path) -> None:
    """Requests of one prefix prefilled in the same step each compute it, but once their
    prefill completes the duplicates go back to the pool: one cached copy remains. (A
    prefix shorter than IN_BATCH_SHARE_MIN: longer ones wait a step for the cache.)"""
    engine = _engine(tiny_llama_dir)
    prefix, *tails = make_prompts(
        engine.runner.vocab_size, [IN_BATCH_SHARE_MIN - 4, 5, 6, 7], seed=4
    )
    for tail in tails:
        engine.submit(prefix + tail, greedy_params(20))
    engine.step()  # all three prefilled together
    usage = engine.scheduler.usage()
    # The prompts sit in the cache (locked) with the prefix held once; nothing else is used.
    held = len(prefix) + sum(len(t) for t in tails)
    assert usage.protected_tokens == held and usage.in_flight_tokens == 0
    assert usage.used_tokens == held
    while engine.has_work():
        engine.step()
    assert engine.num_tracked() == 0


@pytest.mark.slow
def test_prompts_sharing_an_uncached_prefix_prefill_it_once(tiny_llama_dir: Path) -> None:
    # Three prompts over one new 300-token prefix arrive together and one step's chunk
    # could hold them all: the first computes the prefix, the others wait a step for it
    # in the cache instead of computing it again; a prompt sharing nothing is admitted.
    engine = _engine(tiny_llama_dir, chunked_prefill_size=4096)
    prefix, *tails = make_prompts(engine.runner.vocab_size, [300, 20, 25, 30], seed=13)
    (other,) = make_prompts(engine.runner.vocab_size, [40], seed=14)
    prompts = [prefix + tails[0], prefix + tails[1], other, prefix + tails[2]]
    rids = [engine.submit(p, greedy_params(6)) for p in prompts]
    engine.step()
    states = [engine._groups[rid].choices[0].status for rid in rids]
    assert states == [ReqStatus.RUNNING, ReqStatus.WAITING, ReqStatus.RUNNING, ReqStatus.WAITING]
    finals = {}
    while engine.has_work():
        finals.update({out.rid: out.req for out in engine.step() if out.finished})
    assert [finals[rid].cached_tokens >= 299 for rid in rids] == [False, True, False, True]
    assert engine.scheduler.total_prefill_tokens == sum(map(len, prompts)) - sum(
        finals[rid].cached_tokens for rid in rids
    )
    reference = engine_outputs(_engine(tiny_llama_dir, disable_radix_cache=True), prompts, 6)
    assert [finals[rid].output_ids for rid in rids] == reference
