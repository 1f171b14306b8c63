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
from radixserve.engine.request import FinishReason, Req
from tests.unit.engine_helpers import make_prompts


def _engine(model_dir: Path, overlap: bool, **kwargs: Any) -> Engine:
    kwargs.setdefault("debug_check_invariants", True)
    engine = Engine(model_path=str(model_dir), device="cpu", dtype="float32", **kwargs)
    engine.scheduler.overlap = overlap
    return engine


Comparable = tuple[dict[str, Any], list[float]]


def _comparable(out: dict[str, Any]) -> Comparable:
    """The output, and its logprobs apart: batches differ between the modes, so float32
    logprobs differ in the last bits (compared within a tolerance)."""
    meta = {k: v for k, v in out["meta_info"].items() if k not in ("id", "e2e_latency")}
    values: list[float] = []
    if "output_token_logprobs" in meta:
        values += [lp for lp, _ in meta["output_token_logprobs"]]
        meta["output_token_logprobs"] = [t for _, t in meta["output_token_logprobs"]]
    if "output_top_logprobs" in meta:
        values += [lp for top in meta["output_top_logprobs"] for _, lp in top]
        meta["output_top_logprobs"] = [[t for t, _ in top] for top in meta["output_top_logprobs"]]
    return {"output_ids": out["output_ids"], "text": out["text"], **meta}, values


def _assert_same(got: list[Comparable], expected: list[Comparable]) -> None:
    assert [g for g, _ in got] == [e for e, _ in expected]
    for (_, values), (_, reference) in zip(got, expected, strict=True):
        assert values == pytest.approx(reference, abs=1e-4)


def _check_idle(engine: Engine) -> None:
    assert engine.num_tracked() == 0 and not engine.scheduler.has_work()
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size
    penalties = engine.scheduler.penalty_state
    assert len(penalties) == 0 and penalties.capacity == 0  # every row dropped, memory freed


def _run(
    engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]
) -> list[Comparable]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert isinstance(outs, list)
    _check_idle(engine)
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


@pytest.mark.slow
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
    stopped = expected[1][0]
    assert stopped["finish_reason"]["type"] == "stop" or "context_length" in kwargs
    assert stop_id not in stopped["output_ids"][:-1]

    overlapped = _engine(tiny_llama_dir, overlap=True, **kwargs)
    _assert_same(_run(overlapped, prompts, params), expected)
    # The penalized request (frequency_penalty) did not make any step wait for tokens.
    assert overlapped.scheduler.total_exact_state_waits == 0
    if "max_total_tokens" in kwargs:
        assert overlapped.scheduler.total_retractions > 0


@pytest.mark.slow
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


# Negative penalties make the random-weight model repeat itself, so each of these changes
# the output (positive ones rarely would: it seldom repeats a token on its own).
PENALIZED: list[dict[str, Any]] = [
    {"max_new_tokens": 28, "temperature": 0.0, "repetition_penalty": 0.6},
    {"max_new_tokens": 24, "temperature": 0.0, "presence_penalty": -1.5, "frequency_penalty": 0.6},
    {"max_new_tokens": 32, "temperature": 0.0, "repetition_penalty": 0.8, "frequency_penalty": 0.4},
    {"max_new_tokens": 20, "temperature": 0.8, "seed": 4, "n": 2, "frequency_penalty": -1.0},
    {"max_new_tokens": 22, "temperature": 0.0},  # an unpenalized neighbour
]
RETRACTING = {
    "max_total_tokens": 200,
    "chunked_prefill_size": 128,
    "init_new_token_ratio": 0.05,
    "min_new_token_ratio": 0.0,
}


def _drive(
    engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]
) -> tuple[list[Req], int]:
    """Every choice's request in order, run through the step API, and how many steps
    ended with a penalized request's token still on the device (overlapped)."""
    rids = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    done: dict[tuple[str, int], Req] = {}
    overlapped = 0
    while engine.has_work():
        done.update({(out.rid, out.index): out.req for out in engine.step() if out.finished})
        running = engine.scheduler.running
        overlapped += any(r.params.has_penalty and r.num_pending for r in running)
    _check_idle(engine)
    choices = [(rid, i) for rid, q in zip(rids, params, strict=True) for i in range(q.get("n", 1))]
    return [done[c] for c in choices], overlapped


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, RETRACTING], ids=["default", "retracting"])
def test_penalized_requests_run_overlapped(tiny_llama_dir: Path, kwargs: dict[str, Any]) -> None:
    # The plain engine checks after every step that each penalized request's device state
    # equals a rebuild from its token lists (debug_check_invariants).
    plain = _engine(tiny_llama_dir, overlap=False, **kwargs)
    prompts = make_prompts(plain.runner.vocab_size, [30, 12, 60, 8, 40], seed=3)
    expected, _ = _drive(plain, prompts, PENALIZED)
    assert plain.flush_cache()
    keys = ("repetition_penalty", "frequency_penalty", "presence_penalty")
    free = [{k: v for k, v in p.items() if k not in keys} for p in PENALIZED]
    unpenalized, _ = _drive(plain, prompts, free)
    assert all(
        a.output_ids != b.output_ids for a, b in zip(expected[:-1], unpenalized[:-1], strict=True)
    )

    overlapped = _engine(tiny_llama_dir, overlap=True, **kwargs)
    got, overlapped_steps = _drive(overlapped, prompts, PENALIZED)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert overlapped.scheduler.total_exact_state_waits == 0 and overlapped_steps > 0
    if kwargs:  # penalized requests were retracted, and rebuilt their state on re-admission
        assert any(r.num_retractions and r.params.has_penalty for r in got)


@pytest.mark.slow
def test_finished_and_aborted_requests_drop_their_penalty_rows(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, overlap=True)
    state = engine.scheduler.penalty_state
    prompts = make_prompts(engine.runner.vocab_size, [20, 30, 25, 10], seed=2)
    engine.submit(prompts[3], {"max_new_tokens": 30, "temperature": 0.0})
    engine.step()
    engine.step()
    assert state.capacity == 0  # a request without penalties takes nothing
    rids = [
        engine.submit(p, {"max_new_tokens": m, "temperature": 0.0, "frequency_penalty": -1.0})
        for p, m in zip(prompts[:3], [40, 3, 40], strict=True)
    ]
    reqs = [engine._groups[rid].choices[0] for rid in rids]
    engine.step()  # their prefill and first sample: each gets a row
    assert all(state.holds(r) for r in reqs) and len(state) == 3 and state.capacity > 0
    assert engine.abort(rids[0])
    assert not state.holds(reqs[0]) and len(state) == 2
    while not reqs[1].finished:
        engine.step()
    assert reqs[1].finish_reason == FinishReason("length") and not state.holds(reqs[1])
    assert state.holds(reqs[2]) and len(state) == 1
    while engine.has_work():
        engine.step()
    assert len(reqs[2].output_ids) == 40
    assert engine.scheduler.total_exact_state_waits == 0
    _check_idle(engine)
