"""Overlap scheduling gives the same outputs as running each step to completion.

Overlap is on by default on CUDA only (the CPU has nothing to overlap); these tests
switch it on for a CPU engine, where the scheduling logic is the same: the host plans
step N+1 before it reads step N's tokens. tests/gpu checks it on CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from tests.unit.engine_helpers import make_prompts


def _engine(model_dir: Path, overlap: bool, **kwargs: Any) -> Engine:
    kwargs.setdefault("debug_check_invariants", True)
    engine = Engine(model_path=str(model_dir), device="cpu", dtype="float32", **kwargs)
    engine.scheduler.overlap = overlap
    return engine


def _comparable(out: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in out["meta_info"].items() if k not in ("id", "e2e_latency")}
    # Batches differ between the modes, so float32 logprobs differ in the last bits.
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = [
            (round(lp, 4), t) for lp, t in meta["output_token_logprobs"]
        ]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [
            [(t, round(lp, 4)) for t, lp in top] for top in meta["output_top_logprobs"]
        ]
    return {"output_ids": out["output_ids"], "text": out["text"], **meta}


def _run(engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Any]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert isinstance(outs, list)
    assert engine.num_tracked() == 0 and not engine.scheduler.has_work()
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size
    return [_comparable(o) for o in outs]


def _workload(vocab_size: int, stop_id: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    prefix, *tails = make_prompts(vocab_size, [150, 5, 40, 1, 90, 12, 7, 300, 3], seed=21)
    prompts = [prefix + t for t in tails[:4]] + tails[4:]
    params: list[dict[str, Any]] = [
        {"max_new_tokens": 12, "temperature": 0.0},
        {"max_new_tokens": 30, "temperature": 0.0, "stop_token_ids": [stop_id]},
        {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.9, "seed": 5},
        {"max_new_tokens": 7, "temperature": 0.0, "return_logprob": True, "top_logprobs_num": 3},
        {"max_new_tokens": 10, "temperature": 0.7, "n": 2, "seed": 9},
        {"max_new_tokens": 11, "temperature": 0.0, "frequency_penalty": 0.5},
        {"max_new_tokens": 1, "temperature": 0.0},
        {"max_new_tokens": 20, "temperature": 0.0, "stop_token_ids": [stop_id]},
    ]
    return prompts, params


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"chunked_prefill_size": 64, "page_size": 16},
        # A small pool: decode has to retract (and re-prefill) under overlap too.
        {
            "max_total_tokens": 500,
            "chunked_prefill_size": 128,
            "init_new_token_ratio": 0.05,
            "min_new_token_ratio": 0.0,
        },
        {"context_length": 160, "debug_check_invariants": False},
    ],
    ids=["default", "chunked-paged", "retracting", "context-limit"],
)
def test_overlap_equals_step_by_step(tiny_llama_dir: Path, kwargs: dict[str, Any]) -> None:
    plain = _engine(tiny_llama_dir, overlap=False, **kwargs)
    vocab = plain.runner.vocab_size
    # A stop token the second request really produces (its 4th greedy token): the
    # outputs must end right there in both modes, with nothing emitted past it.
    limit = 150 if "context_length" in kwargs else None  # outputs hit the context limit
    probe_prompts, _ = _workload(vocab, stop_id=0)
    probe = plain.generate(
        input_ids=probe_prompts[1][:limit],
        sampling_params={"max_new_tokens": 6, "temperature": 0.0},
    )
    assert isinstance(probe, dict)
    stop_id = probe["output_ids"][3]
    assert plain.flush_cache()  # both modes start from an empty cache
    prompts, params = _workload(vocab, stop_id)
    prompts = [p[:limit] for p in prompts]
    expected = _run(plain, prompts, params)
    stopped = expected[1]
    assert stopped["finish_reason"]["type"] == "stop" or "context_length" in kwargs
    assert stop_id not in stopped["output_ids"][:-1]

    overlapped = _engine(tiny_llama_dir, overlap=True, **kwargs)
    assert _run(overlapped, prompts, params) == expected
    if "max_total_tokens" in kwargs:
        assert overlapped.scheduler.total_retractions > 0


def test_overlap_keeps_a_step_in_flight(tiny_llama_dir: Path) -> None:
    """The step API under overlap: tokens arrive one step late, aborts free everything."""
    engine = _engine(tiny_llama_dir, overlap=True)
    prompts = make_prompts(engine.runner.vocab_size, [20, 30, 25], seed=2)
    rids = [engine.submit(p, {"max_new_tokens": 50, "temperature": 0.0}) for p in prompts]
    assert engine.step() == []  # the prefill is launched; its tokens are read next step
    assert engine.scheduler._inflight is not None
    first = engine.step()
    assert sorted(o.rid for o in first) == sorted(rids)
    assert all(len(o.new_token_ids) == 1 for o in first)
    assert not engine.scheduler.flush_cache()  # a step is in flight
    for rid in rids[:2]:
        assert engine.abort(rid)
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out.req
    assert sorted(finals) == sorted(rids)
    assert [finals[r].finish_reason.kind for r in rids] == ["abort", "abort", "length"]
    assert len(finals[rids[2]].output_ids) == 50
    assert all(r.num_pending == 0 for r in finals.values())
    usage = engine.scheduler.usage()
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size
    assert engine.flush_cache()
