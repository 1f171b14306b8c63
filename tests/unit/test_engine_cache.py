"""Prefix reuse, abort and the KV accounting around them."""

from __future__ import annotations

from pathlib import Path

from radixserve import Engine
from radixserve.engine.request import ReqStatus
from tests.unit.engine_helpers import engine_outputs, greedy_params, make_prompts


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )


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
