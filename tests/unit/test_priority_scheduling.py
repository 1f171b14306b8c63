"""Request priority in the engine's waiting queue: a higher priority is admitted first,
the schedule policy orders within one priority, a request waiting past the starvation
bound goes ahead of every priority, and none of it changes what greedy decoding says.
Also priority's way from the wire (tokenizer -> scheduler -> worker) into `Req`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine.config import EngineConfig
from radixserve.engine.flags import add_engine_arguments, engine_kwargs
from radixserve.engine.request import Req
from radixserve.engine.sched.policy import order_waiting
from radixserve.prep.prompt import PromptIds
from radixserve.prep.request import tokenized_request
from radixserve.protocol import (
    Heartbeat,
    RoutedRequest,
    SubmitRequest,
    TokenizedRequest,
    WorkerCapacity,
    WorkerStatus,
    decode,
    encode,
)
from radixserve.routing import Dispatcher, Routed
from radixserve.worker.convert import submit_request
from tests.unit.engine_helpers import greedy_params, make_prompts

MAX_NEW = 3
STEPS = 24  # of the starvation test: one second each, the bound is 10


@dataclass
class FakeClock:
    """The scheduler's clock, moved by the test (no sleeps)."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(model_dir: Path, clock: FakeClock | None = None, **kwargs: object) -> Engine:
    engine = Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )
    if clock is not None:
        engine.scheduler.clock = clock
    return engine


@pytest.fixture
def engines(tiny_llama_dir: Path) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.shutdown()


def _waiting_rids(engine: Engine) -> set[str]:
    return {r.rid for r in engine.scheduler.waiting}


def _run(engine: Engine) -> tuple[list[str], dict[str, list[int]]]:
    """Step until idle; returns the rids in the order they were admitted and every
    request's output ids. A request whose prefill completes joins the running list in
    the adder's order and stays there while it decodes (max_new_tokens > 1)."""
    admitted: list[str] = []
    outputs: dict[str, list[int]] = {}
    for _ in range(500):  # far more steps than any test needs: a stuck queue fails
        if not engine.has_work():
            return admitted, outputs
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        admitted += [r.rid for r in engine.scheduler.running if r.rid not in admitted]
    raise AssertionError("the engine did not go idle")


@pytest.mark.slow
def test_higher_priority_is_admitted_before_earlier_lower_and_outputs_are_unchanged(
    tiny_llama_dir: Path, engines: list[Engine]
) -> None:
    """max_running_requests 2 and six queued at once: the two of priority 5, queued
    last, run first, then priority 1, then 0; arrival order within each (fcfs). The
    greedy tokens are those of the same prompts queued without priorities."""
    priorities = [0, 0, 1, 0, 5, 5]
    outputs: dict[int, dict[str, list[int]]] = {}
    for prioritized in (False, True):
        engine = _engine(tiny_llama_dir, max_running_requests=2, schedule_policy="fcfs")
        engines.append(engine)
        prompts = make_prompts(engine.runner.vocab_size, [9, 14, 7, 20, 11, 16], seed=5)
        for i, (ids, priority) in enumerate(zip(prompts, priorities, strict=True)):
            engine.submit(
                ids, greedy_params(MAX_NEW), rid=f"r-{i}", priority=priority if prioritized else 0
            )
        admitted, outputs[prioritized] = _run(engine)
        expected = (
            ["r-4", "r-5", "r-2", "r-0", "r-1", "r-3"]
            if prioritized
            else [f"r-{i}" for i in range(6)]
        )
        assert admitted == expected
    assert outputs[True] == outputs[False]
    assert all(len(ids) == MAX_NEW for ids in outputs[True].values())


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("lpm", ["r-high", "r-cached", "r-early"]), ("fcfs", ["r-high", "r-early", "r-cached"])],
)
def test_the_policy_orders_within_one_priority(
    tiny_llama_dir: Path, engines: list[Engine], policy: str, expected: list[str]
) -> None:
    """Two of priority 0 (the second's prefix is cached) and one of priority 1, queued
    last: priority 1 runs first under either policy; then lpm takes the cached prefix
    first, fcfs the earlier arrival."""
    engine = _engine(tiny_llama_dir, max_running_requests=1, schedule_policy=policy)
    engines.append(engine)
    prefix, early, tail, high = make_prompts(engine.runner.vocab_size, [40, 12, 6, 10], seed=9)
    engine.generate(input_ids=prefix, sampling_params=greedy_params(1))  # caches the prefix
    engine.submit(early, greedy_params(MAX_NEW), rid="r-early")
    engine.submit(prefix + tail, greedy_params(MAX_NEW), rid="r-cached")
    engine.submit(high, greedy_params(MAX_NEW), rid="r-high", priority=1)
    assert _run(engine)[0] == expected


@pytest.mark.slow
@pytest.mark.parametrize("bound_s", [10.0, 0.0])
def test_a_low_priority_request_is_admitted_once_it_waited_past_the_bound(
    tiny_llama_dir: Path, engines: list[Engine], bound_s: float
) -> None:
    """One running at a time and a new priority-1 request queued after every step (one
    second each on the injected clock), so one always waits: the priority-0 request
    queued first is admitted at the first admission past 10 s, and finishes with the
    tokens it gets alone. Without a bound (0) it is never admitted while they come."""
    clock = FakeClock()
    engine = _engine(tiny_llama_dir, clock, max_running_requests=1, priority_starvation_s=bound_s)
    engines.append(engine)
    vocab = engine.runner.vocab_size
    low_prompt = make_prompts(vocab, [13], seed=21)[0]
    alone = engine.generate(input_ids=low_prompt, sampling_params=greedy_params(MAX_NEW))
    assert isinstance(alone, dict)
    engine.submit(low_prompt, greedy_params(MAX_NEW), rid="low")
    high_prompts = iter(make_prompts(vocab, [8] * STEPS, seed=22))
    admissions: list[tuple[str, float]] = []  # (rid, the clock when admitted)
    low: list[int] = []
    for i in range(STEPS):
        engine.submit(next(high_prompts), greedy_params(1), rid=f"high-{i}", priority=1)
        before = _waiting_rids(engine)
        for out in engine.step():
            if out.rid == "low":
                low += out.new_token_ids
        admissions += [(rid, clock.now) for rid in before - _waiting_rids(engine)]
        assert len(engine.scheduler.waiting) >= 1  # a high one always waits
        clock.now += 1.0
    admitted = [rid for rid, _ in admissions]
    if bound_s == 0.0:
        assert "low" not in admitted and len(admitted) == STEPS  # one high each step
        return
    assert next(rid for rid, at in admissions if at > bound_s) == "low"
    assert "low" not in [rid for rid, at in admissions if at <= bound_s]
    assert low == alone["output_ids"]  # it finished, with the tokens it gets alone


def test_one_priority_keeps_the_policy_order_whatever_the_clock(
    tiny_llama_dir: Path, engines: list[Engine]
) -> None:
    """All waiting at one priority (any value): the order is the policy's alone, the
    one it gives with no priorities, even with every request far past the bound. With
    two levels, requests past the bound go by arrival; with no bound, by level."""
    engine = _engine(tiny_llama_dir, max_running_requests=1)
    engines.append(engine)
    prefix, *tails = make_prompts(engine.runner.vocab_size, [30, 5, 9, 4, 7], seed=31)
    engine.generate(input_ids=prefix, sampling_params=greedy_params(1))
    for i, tail in enumerate(tails):
        ids = prefix + tail if i % 2 else tail  # the odd ones hit the cache
        engine.submit(ids, greedy_params(1), rid=f"r-{i}", priority=3)
    waiting = list(engine.scheduler.waiting)
    kv = engine.scheduler.kv
    lpm = [r.rid for r in order_waiting("lpm", waiting, kv, 128, 0.0, 10.0)]
    assert lpm == ["r-1", "r-3", "r-0", "r-2"]  # cached prefix first, then arrival
    assert [r.rid for r in order_waiting("lpm", waiting, kv, 128, 1e9, 10.0)] == lpm
    waiting[1].priority = 0  # r-1, one level down, and every request past the bound:
    starved = [r.rid for r in order_waiting("lpm", waiting, kv, 128, 1e9, 10.0)]
    assert starved == ["r-0", "r-1", "r-2", "r-3"]  # all by arrival
    strict = [r.rid for r in order_waiting("lpm", waiting, kv, 128, 1e9, 0.0)]
    assert strict == ["r-3", "r-0", "r-2", "r-1"]  # without a bound: by level, then lpm


def _routed_over_the_wire(submit: SubmitRequest, prompt: list[int]) -> TokenizedRequest:
    """The tokenizer's message, through the scheduler's dispatcher, as the worker
    decodes it."""
    tokenized = decode(
        encode(tokenized_request(submit, PromptIds(prompt, "prompt"))), TokenizedRequest
    )
    dispatcher = Dispatcher(
        max_pending_requests=4, worker_timeout_s=5.0, retry_after_s=1.0, routing="least_load"
    )
    capacity = WorkerCapacity(max_running_requests=4, max_total_num_tokens=512, max_context_len=512)
    beat = Heartbeat(
        worker_id="w0", time=0.0, status=WorkerStatus.READY, capacity=capacity, epoch=1
    )
    dispatcher.on_heartbeat(beat, now=0.0)
    decision = dispatcher.admit(tokenized, now=0.0, wall_time=0.0)
    assert isinstance(decision, Routed)
    return decode(encode(decision.routed), RoutedRequest).request


def test_priority_reaches_the_engine_from_the_wire(
    tiny_llama_dir: Path, engines: list[Engine]
) -> None:
    engine = _engine(tiny_llama_dir)
    engines.append(engine)
    prompt = make_prompts(engine.runner.vocab_size, [6], seed=41)[0]
    for rid, priority in (("given", 7), ("negative", -2)):
        submit = SubmitRequest(rid=rid, gateway_id="gw-1", text="x", priority=priority)
        request = _routed_over_the_wire(submit, prompt)
        assert request.priority == priority
        submit_request(engine, request)
    submit = SubmitRequest(rid="default", gateway_id="gw-1", text="x")
    submit_request(engine, _routed_over_the_wire(submit, prompt))
    queued = {r.rid: r.priority for r in engine.scheduler.waiting}
    assert queued == {"given": 7, "negative": -2, "default": 0}


def test_the_choices_of_one_prompt_keep_its_priority_and_arrival(
    tiny_llama_dir: Path, engines: list[Engine]
) -> None:
    """n = 2: the hidden shared prefill and then both choices carry the priority, and
    the choices, queued after the prefill, count their wait from the prompt's arrival."""
    clock = FakeClock(now=100.0)
    engine = _engine(tiny_llama_dir, clock)
    engines.append(engine)
    prompt = make_prompts(engine.runner.vocab_size, [10], seed=51)[0]
    engine.submit(prompt, {"max_new_tokens": 2, "n": 2}, rid="multi", priority=4)
    (prefill,) = engine.scheduler.waiting
    assert (prefill.rid, prefill.priority, prefill.arrival_time) == ("multi-prefill", 4, 100.0)
    clock.now = 105.0
    choices: list[Req] = []
    while engine.has_work() and not choices:
        engine.step()
        choices = [r for r in engine.scheduler.waiting if r.rid.startswith("multi-")]
    assert sorted(r.rid for r in choices) == ["multi-0", "multi-1"]
    assert all((r.priority, r.arrival_time) == (4, 100.0) for r in choices)


def test_bad_priorities_and_bounds_are_refused(tiny_llama_dir: Path, engines: list[Engine]) -> None:
    engine = _engine(tiny_llama_dir)
    engines.append(engine)
    for bad in (True, 1.5, "2"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.submit([5, 6, 7], {"max_new_tokens": 1}, priority=bad)  # type: ignore[arg-type]
    assert not engine.scheduler.waiting and engine.num_tracked() == 0
    for bound in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="priority_starvation_s must be >= 0"):
            EngineConfig(priority_starvation_s=bound)


def test_the_bound_is_a_flag_and_a_variable() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flagged = engine_kwargs(parser.parse_args(["--priority-starvation-s", "3"]), environ={})
    assert flagged == {"priority_starvation_s": 3.0}
    env = {"RADIXSERVE_PRIORITY_STARVATION_S": "2.5"}
    assert engine_kwargs(parser.parse_args([]), environ=env) == {"priority_starvation_s": 2.5}
    assert EngineConfig().priority_starvation_s == 10.0
    env = {"RADIXSERVE_PRIORITY_STARVATION_S": "soon"}
    with pytest.raises(ValueError, match="RADIXSERVE_PRIORITY_STARVATION_S='soon'"):
        engine_kwargs(parser.parse_args([]), environ=env)
