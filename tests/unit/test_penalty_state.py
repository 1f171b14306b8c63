"""The device penalty state against `Penalties.build` over the same token lists.

A simulated scheduler: requests join and leave between steps, steps sample random ids,
tokens stay pending for a step (overlap) or are read at once, and some requests are
invalidated (retraction, jump-forward appending forced tokens on the host). At every
step the penalties gathered from the state must give exactly the logits of the rebuild.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.engine.request import Req
from radixserve.engine.sampling import SamplingBatch, SamplingParams, sample
from radixserve.engine.sampling.penalties import Penalties
from radixserve.engine.sampling.penalty_state import MIN_ROWS, PenaltyState

VOCAB = 50
SETTINGS = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"frequency_penalty": 0.5},
    {"presence_penalty": -0.4},
    {"frequency_penalty": -1.2, "presence_penalty": 1.1},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.3, "presence_penalty": 0.2},
    {},  # no penalty: never takes a row
    {"temperature": 0.8},
]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _req(rng: random.Random, number: int) -> Req:
    params = SamplingParams(**{"temperature": 0.0, **rng.choice(SETTINGS)})
    return Req(
        rid=str(number),
        # Tokens from a narrow range repeat often, so counts go past 1.
        origin_input_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(12))],
        params=params,
        seed=number,
        stop_token_ids=frozenset(),
        output_ids=[rng.randrange(VOCAB // 3) for _ in range(rng.randrange(6))],
    )


def _rebuilt(reqs: list[Req], pending: dict[Req, int], device: str) -> Penalties | None:
    """The reference: every row's tensors from its full token lists, pending token included."""
    outputs = [r.output_ids + ([pending[r]] if r in pending else []) for r in reqs]
    return Penalties.build(
        [r.params.repetition_penalty for r in reqs],
        [r.params.frequency_penalty for r in reqs],
        [r.params.presence_penalty for r in reqs],
        [r.origin_input_ids for r in reqs],
        outputs,
        VOCAB,
        torch.device(device),
    )


def _simulate(seed: int, steps: int, device: str) -> int:
    """Run the simulation; returns the largest number of rows the state held."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    state = PenaltyState(VOCAB, torch.device(device), max_rows=12)  # then one by one
    running: list[Req] = []  # sampled at least once since they joined or were rebuilt
    waiting: list[Req] = []
    pending: dict[Req, int] = {}  # the token each request has on the device, not read yet
    numbers = iter(range(10**6))
    most = 0
    for _ in range(steps):
        waiting += [_req(rng, next(numbers)) for _ in range(rng.randrange(4))]
        for req in rng.sample(running, min(len(running), rng.randrange(3))):
            running.remove(req)  # finished or aborted: a pending token is dropped
            pending.pop(req, None)
            req.num_pending = 0
            state.release(req)
        for req in [r for r in running if r not in pending and rng.random() < 0.15]:
            running.remove(req)  # retracted, or jump-forward appended forced tokens
            state.release(req)
            req.output_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(3))]
            waiting.append(req)
        admitted = rng.sample(waiting, min(len(waiting), rng.randrange(1, 4)))
        batch = [r for r in running if rng.random() < 0.9] + admitted
        if not batch:
            continue
        rng.shuffle(batch)
        logits = torch.randn(len(batch), VOCAB, generator=gen) * 3
        logits[torch.rand(logits.shape, generator=gen) < 0.1] = float("-inf")  # grammar masks
        logits = logits.to(device)

        got = SamplingBatch.build(batch, VOCAB, device, state)
        expected = _rebuilt(batch, pending, device)
        assert (got.penalties is None) == (expected is None)
        if got.penalties is not None and expected is not None:
            assert torch.equal(got.penalties.apply(logits), expected.apply(logits))
        reference = sample(logits, replace(got, penalties=expected)).next_token_ids
        assert torch.equal(sample(logits, got).next_token_ids, reference)

        next_ids = torch.randint(VOCAB // 3, (len(batch),), generator=gen).to(device)
        state.accept(got.penalties, next_ids)
        for req in admitted:
            waiting.remove(req)
            running.append(req)
        overlap = rng.random() < 0.6
        for req, token in zip(batch, next_ids.tolist(), strict=True):
            if req in pending:  # the previous step's token is read while this one runs
                req.output_ids.append(pending.pop(req))
            if overlap:
                pending[req] = token
                req.num_pending = 1
            else:
                req.output_ids.append(token)
                req.num_pending = 0
        for req in [r for r in pending if r not in batch]:
            req.output_ids.append(pending.pop(req))
            req.num_pending = 0
        state.check(running)
        most = max(most, len(state))
    for req in running:
        state.release(req)
    assert len(state) == 0 and state.capacity == 0
    return most


@pytest.mark.parametrize("device", DEVICES)
def test_state_equals_rebuild_with_rows_joining_and_leaving(device: str) -> None:
    most = max(_simulate(seed, steps=25, device=device) for seed in range(4))
    assert most > MIN_ROWS  # the state grew past its first allocation


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_state_equals_rebuild_random(seed: int) -> None:
    _simulate(seed, steps=10, device="cpu")


def test_requests_without_penalties_take_nothing() -> None:
    state = PenaltyState(VOCAB, torch.device("cpu"), max_rows=256)
    reqs = [
        Req(str(i), [1, 2, 3], SamplingParams(temperature=0.5), i, frozenset()) for i in range(5)
    ]
    assert state.gather(reqs) is None
    assert SamplingBatch.build(reqs, VOCAB, "cpu", state).penalties is None
    assert len(state) == 0 and state.capacity == 0


def test_growth_doubles_up_to_max_rows() -> None:
    state = PenaltyState(VOCAB, torch.device("cpu"), max_rows=20)
    params = SamplingParams(presence_penalty=1.0)
    capacities = []
    for i in range(22):
        state.gather([Req(str(i), [i], params, i, frozenset())])
        capacities.append(state.capacity)
    assert capacities == [MIN_ROWS] * 8 + [16] * 8 + [20] * 4 + [21, 22]


def test_rows_are_dropped_and_reused() -> None:
    state = PenaltyState(VOCAB, torch.device("cpu"), max_rows=256)
    first = Req("a", [4, 4, 5], SamplingParams(frequency_penalty=1.0), 0, frozenset(), [4])
    second = Req("b", [6], SamplingParams(repetition_penalty=1.2), 0, frozenset(), [7, 7])
    penalties = state.gather([first, second])
    assert penalties is not None and penalties.rows is None  # every row penalized: no gather
    state.accept(penalties, torch.tensor([4, 9]))
    assert state.holds(first) and state.holds(second) and state.capacity == MIN_ROWS
    state.release(first)
    state.release(first)  # twice is harmless
    assert not state.holds(first) and state.capacity == MIN_ROWS
    # A new request reuses the freed row, built from scratch: nothing of `first` is left.
    third = Req("c", [1], SamplingParams(presence_penalty=0.5), 0, frozenset())
    plain = Req("d", [1], SamplingParams(), 0, frozenset())
    penalties = state.gather([plain, third])
    assert penalties is not None and penalties.rows is not None
    assert penalties.rows.tolist() == [1] and penalties.output_counts is not None
    assert penalties.output_counts.sum() == 0 and penalties.seen_tokens is None
    second.output_ids.append(9)
    state.check([second, third, plain])
    state.release(second)
    state.release(third)
    assert len(state) == 0 and state.capacity == 0


def test_check_catches_a_leak_and_a_drift() -> None:
    state = PenaltyState(VOCAB, torch.device("cpu"), max_rows=256)
    req = Req("a", [3], SamplingParams(frequency_penalty=1.0), 0, frozenset(), [5])
    penalties = state.gather([req])
    with pytest.raises(AssertionError, match="disagree"):
        state.check([])  # the request left without releasing its row
    state.accept(penalties, torch.tensor([5]))
    with pytest.raises(AssertionError, match="drifted"):
        state.check([req])  # the host never read the token the state counted
    req.output_ids.append(5)
    state.check([req])
