"""Sampling params, batch tensors and the batched sampler against per-request references."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from radixserve.engine.sampling import (
    SampleResult,
    SamplingBatch,
    SamplingParams,
    SamplingRequest,
    resolve_seed,
    sample,
)
from radixserve.engine.sampling.noise import MASK32, fmix32, row_uniforms, uniform_from_hash
from radixserve.engine.sampling.penalties import Penalties

# ---------------------------------------------------------------- helpers and references


def make_req(
    seed: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    stop: frozenset[int] = frozenset(),
    **params: Any,
) -> SamplingRequest:
    return SamplingRequest(
        params=SamplingParams(**params),
        seed=seed,
        origin_input_ids=prompt,
        output_ids=output,
        stop_token_ids=stop,
    )


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(logits: torch.Tensor, reqs: Sequence[SamplingRequest], device: str = "cpu") -> SampleResult:
    """Sample on `device`; the result comes back on the CPU."""
    logits = logits.to(device)
    result = sample(logits, SamplingBatch.build(reqs, logits.shape[-1], logits.device))
    assert result.next_token_ids.device == logits.device

    def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu()

    return SampleResult(
        next_token_ids=result.next_token_ids.cpu(),
        logprobs=cpu(result.logprobs),
        top_logprob_ids=cpu(result.top_logprob_ids),
        top_logprob_values=cpu(result.top_logprob_values),
    )


def ref_penalize(
    row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """One request, token by token, in float32 (the order the sampler documents)."""
    out = row.float().clone()
    rep = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    freq = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        for t, count in Counter(output).items():
            out[t] = out[t] - freq * float(count)
            out[t] = out[t] - pres
    return out


def ref_filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 probabilities after temperature, top-k, top-p (of the top-k renormalized
    distribution; ties by token id) and min-p, renormalized. Zero = not allowed."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k > 0:
        kth = sorted(probs.tolist(), reverse=True)[min(p.top_k, probs.numel()) - 1]
        keep &= probs >= kth
    if p.top_p < 1.0:
        q = torch.where(keep, probs, 0.0)
        q = q / q.sum()
        mass = 0.0
        for j in sorted(range(q.numel()), key=lambda j: (-float(q[j]), j)):
            if mass > p.top_p:
                keep[j] = False
            mass += float(q[j])
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def chi_square(observed: Counter[int], expected_probs: torch.Tensor, total: int) -> float:
    """Pearson's statistic; a draw where the expected probability is 0 is infinite."""
    stat = 0.0
    for token, prob in enumerate(expected_probs.tolist()):
        seen = observed.get(token, 0)
        if prob == 0.0:
            if seen:
                return math.inf
            continue
        stat += (seen - total * prob) ** 2 / (total * prob)
    return stat


def chi_square_limit(dof: int) -> float:
    """~99.95% quantile of chi-square(dof) (Wilson-Hilferty): a false alarm 1 time in 2000."""
    z = 3.29
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def draws(
    logits_row: torch.Tensor,
    n: int,
    first_seed: int = 0,
    step: int = 0,
    device: str = "cpu",
    **params: Any,
) -> list[int]:
    """n requests with the same logits and seeds first_seed.., sampled in one batch."""
    reqs = [make_req(seed=first_seed + i, output=range(step), **params) for i in range(n)]
    return run(logits_row.expand(n, -1).contiguous(), reqs, device).next_token_ids.tolist()


# ---------------------------------------------------------------- params


def test_defaults_follow_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.n, p.seed, p.top_logprobs_num) == ([], [], 1, None, 0)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not (p.ignore_eos or p.no_stop_trim or p.return_logprob)
    p.validate(vocab_size=10)


def test_from_dict() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    p = SamplingParams.from_dict(
        {"temperature": 0, "stop": "###", "max_new_tokens": None, "regex": "[a-z]+"}
    )
    assert p.temperature == 0 and p.stop == ["###"] and p.max_new_tokens == 128
    assert p.regex == "[a-z]+"
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    with pytest.raises(ValueError, match="'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="sampling_params must be an object"):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.1),
        ("max_new_tokens", -1),
        ("max_new_tokens", 1.5),
        ("min_new_tokens", 200),
        ("n", 0),
        ("stop_token_ids", [3, 100]),
        ("stop_token_ids", [-1]),
        ("top_logprobs_num", -1),
        ("top_logprobs_num", 21),
        ("stop", [1]),
        ("ignore_eos", "yes"),
        ("seed", 1.0),
        ("json_schema", "{}"),  # with regex set below: two grammars
    ],
)
def test_validate_names_the_bad_field(field: str, value: object) -> None:
    values: dict[str, Any] = {field: value}
    if field == "json_schema":
        values["regex"] = "a+"
    params = SamplingParams.from_dict(values)
    with pytest.raises(ValueError, match=f"'{field}'"):
        params.validate(vocab_size=100)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(top_k=2).is_greedy


def test_resolve_seed() -> None:
    assert resolve_seed(SamplingParams(seed=42)) == 42
    first = resolve_seed(SamplingParams(), torch.Generator().manual_seed(7))
    again = resolve_seed(SamplingParams(), torch.Generator().manual_seed(7))
    other = resolve_seed(SamplingParams(), torch.Generator().manual_seed(8))
    assert first == again != other
    assert 0 <= first < 2**62


# ---------------------------------------------------------------- noise


def _fmix32_python(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def test_fmix32_matches_murmur3_reference() -> None:
    rng = random.Random(0)
    values = [0, 1, MASK32, 2**31, 2**31 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    got = fmix32(np.array(values, dtype=np.uint32)).tolist()
    assert got == [_fmix32_python(v) for v in values]


def test_row_uniforms_are_open_unit_and_spread() -> None:
    n = 20000
    u = row_uniforms(list(range(n)), [0] * n)
    assert u.dtype == np.float32 and bool(((u > 0) & (u < 1)).all())
    counts = Counter((u * 10).astype(np.int64).tolist())
    assert chi_square(counts, torch.full((10,), 0.1), n) < chi_square_limit(9)


def test_uniform_extremes_stay_inside_and_any_int_seed_works() -> None:
    edges = uniform_from_hash(np.array([0, MASK32], dtype=np.uint32))
    assert 0.0 < edges[0] < 1e-6 and 1.0 - 1e-6 < edges[1] < 1.0
    # mod 2**64: -1 == 2**64 - 1 and 2**70 + 5 == 5; a high word alone changes the draw.
    seeds = [-1, 2**64 - 1, 2**70 + 5, 5, 5 + 2**32]
    u = row_uniforms(seeds, [3] * len(seeds)).tolist()
    assert u[0] == u[1] and u[2] == u[3] and len({u[1], u[3], u[4]}) == 3


# ---------------------------------------------------------------- greedy and filters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype, device: str) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 7] = logits[0, 3] = 10.0  # a tie takes the first index
    reqs = [make_req(seed=i, temperature=0.0) for i in range(4)]
    reqs += [make_req(seed=i, temperature=0.9, top_k=1) for i in range(4)]
    got = run(logits, reqs, device).next_token_ids
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert got[0] == 3


FILTERS = [
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.7, "top_p": 0.6},
    {"temperature": 1.3, "min_p": 0.2},
    {"temperature": 0.9, "top_k": 12, "top_p": 0.5},
    {"temperature": 1.1, "top_k": 30, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 1e-6},  # keeps only the most probable token
]


@pytest.mark.parametrize("params", FILTERS)
def test_filters_never_leave_the_allowed_set(params: dict[str, Any], device: str) -> None:
    row = torch.randn(200, generator=torch.Generator().manual_seed(1)) * 2
    allowed = set(ref_filtered_probs(row, SamplingParams(**params)).nonzero().flatten().tolist())
    seen: set[int] = set()
    for step in (0, 5):
        seen |= set(draws(row, 1000, device=device, step=step, **params))
    assert seen <= allowed
    # Not vacuous: the draws spread over the allowed set.
    assert len(seen) >= min(len(allowed), 3)


def test_filters_per_row_in_one_batch(device: str) -> None:
    """Rows with different filters share a batch (the sort path); each keeps its own set."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(len(FILTERS) * 100, 80, generator=gen) * 2
    reqs = [make_req(seed=i, **FILTERS[i % len(FILTERS)]) for i in range(logits.shape[0])]
    got = run(logits, reqs, device).next_token_ids.tolist()
    for row, req in enumerate(reqs):
        assert ref_filtered_probs(logits[row], req.params)[got[row]] > 0


# ---------------------------------------------------------------- distributions


def test_distribution_matches_softmax_over_temperature(device: str) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    observed = Counter(draws(row, n, device=device, temperature=0.8))
    stat = chi_square(observed, torch.softmax(row.double() / 0.8, -1), n)
    assert stat < chi_square_limit(7)
    # The test has power: the same draws reject the wrong temperature.
    assert chi_square(observed, torch.softmax(row.double(), -1), n) > 10 * chi_square_limit(7)


def test_distribution_of_one_seed_over_steps(device: str) -> None:
    """One request's successive draws (one seed, output positions 0..n-1) are softmax-distributed."""
    row = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.3])
    n = 6000
    reqs = [make_req(seed=1234, output=range(step)) for step in range(n)]
    observed = Counter(run(row.expand(n, -1).contiguous(), reqs, device).next_token_ids.tolist())
    assert chi_square(observed, torch.softmax(row.double(), -1), n) < chi_square_limit(4)


def test_rows_without_top_k_ignore_a_top_k_neighbour(device: str) -> None:
    """top-k without top-p takes the torch.topk path; rows with top-k off must keep all."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 16000
    reqs = [make_req(seed=i, top_k=2 if i % 2 else -1) for i in range(n)]
    got = run(row.expand(n, -1).contiguous(), reqs, device).next_token_ids.tolist()
    assert set(got[1::2]) == {0, 6}
    observed = Counter(got[0::2])
    assert chi_square(observed, torch.softmax(row.double(), -1), n // 2) < chi_square_limit(7)


def test_distribution_after_filters_is_renormalized(device: str) -> None:
    row = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = {"temperature": 1.2, "top_k": 7, "top_p": 0.85, "min_p": 0.05}
    expected = ref_filtered_probs(row, SamplingParams(**params))
    assert 3 <= int((expected > 0).sum()) < 7  # every filter matters here
    n = 20000
    observed = Counter(draws(row, n, device=device, first_seed=10**6, **params))
    dof = int((expected > 0).sum()) - 1
    assert chi_square(observed, expected, n) < chi_square_limit(dof)


# ---------------------------------------------------------------- penalties, min tokens


def test_penalties_match_reference_exactly(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(6, vocab, generator=gen) * 3
    rng = random.Random(3)
    settings = [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7},
        {"frequency_penalty": 0.5, "presence_penalty": -0.4},
        {"repetition_penalty": 1.5, "frequency_penalty": -1.2, "presence_penalty": 1.1},
        {},
        {"presence_penalty": 2.0},
    ]
    reqs = [
        make_req(
            prompt=[rng.randrange(vocab) for _ in range(15)],
            output=[rng.randrange(vocab // 2) for _ in range(25)],  # many repeats
            temperature=0.0,
            **s,
        )
        for s in settings
    ]
    batch = SamplingBatch.build(reqs, vocab, device)
    assert batch.penalties is not None
    got = batch.penalties.apply(logits.to(device)).cpu()
    expected = torch.stack(
        [
            ref_penalize(logits[i], r.params, r.origin_input_ids, r.output_ids)
            for i, r in enumerate(reqs)
        ]
    )
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)
    # And end to end: greedy takes the argmax of the penalized logits.
    assert torch.equal(sample(logits.to(device), batch).next_token_ids.cpu(), expected.argmax(-1))


def test_penalties_are_none_without_penalties() -> None:
    assert Penalties.build([1.0], [0.0], [0.0], [[1]], [[2]], 10, torch.device("cpu")) is None


def test_min_new_tokens_masks_stop_ids(device: str) -> None:
    vocab, eos, stop_id = 20, 0, 7
    logits = torch.zeros(4, vocab)
    logits[:, eos] = 50.0
    logits[:, stop_id] = 40.0
    stop = frozenset({eos, stop_id})
    reqs = [
        make_req(output=[3, 3], stop=stop, min_new_tokens=3, temperature=0.0),  # masked
        make_req(output=[3, 3, 3], stop=stop, min_new_tokens=3, temperature=0.0),  # free
        make_req(output=[3], stop=stop, min_new_tokens=3, temperature=1.0, seed=5),  # masked
        make_req(output=[3], stop=frozenset(), min_new_tokens=3, temperature=0.0),  # no stops
    ]
    got = run(logits, reqs, device).next_token_ids.tolist()
    assert got[0] not in stop and got[2] not in stop
    assert got[1] == eos and got[3] == eos


def test_min_new_tokens_never_samples_a_stop_id(device: str) -> None:
    row = torch.zeros(10)
    row[0] = 5.0  # eos would win most draws
    reqs = [make_req(seed=i, stop=frozenset({0, 3}), min_new_tokens=2) for i in range(500)]
    got = run(row.expand(500, -1).contiguous(), reqs, device).next_token_ids.tolist()
    assert not {0, 3} & set(got) and len(set(got)) == 8


# ---------------------------------------------------------------- seeds and batches


def _mixed_companions(vocab: int) -> list[SamplingRequest]:
    """Requests that force every code path: greedy, top-p sort, penalties, min tokens."""
    return [
        make_req(temperature=0.0),
        make_req(seed=99, top_p=0.3, output=[1, 2, 2]),
        make_req(seed=7, repetition_penalty=1.5, frequency_penalty=0.3, prompt=[4, 5], output=[5]),
        make_req(seed=8, top_k=vocab + 10, min_p=0.1, stop=frozenset({0}), min_new_tokens=9),
    ]


def test_seed_gives_same_token_alone_and_in_any_batch(device: str) -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(4)
    subjects = [
        make_req(seed=1000 + i, output=range(i % 9), temperature=0.9, top_k=100) for i in range(48)
    ]
    rows = torch.randn(len(subjects), vocab, generator=gen)
    alone = [
        run(rows[i : i + 1], [s], device).next_token_ids.item() for i, s in enumerate(subjects)
    ]
    # All together, then interleaved with companions that switch on sort, penalties, masks.
    together = run(rows, subjects, device).next_token_ids.tolist()
    companions = _mixed_companions(vocab)
    mixed_reqs: list[SamplingRequest] = []
    mixed_rows: list[torch.Tensor] = []
    for i, subject in enumerate(subjects):
        mixed_reqs += [companions[i % len(companions)], subject]
        mixed_rows += [torch.randn(vocab, generator=gen), rows[i]]
    mixed = run(torch.stack(mixed_rows), mixed_reqs, device).next_token_ids.tolist()[1::2]
    assert alone == together == mixed
    assert len(set(alone)) > 30  # different seeds (and logits) give different tokens


def test_different_seeds_and_steps_differ(device: str) -> None:
    row = torch.zeros(1000)  # uniform: any repeat is chance (p ~ 1/1000)
    by_seed = draws(row, 64, device=device, first_seed=5)
    assert len(set(by_seed)) >= 60
    by_step = [draws(row, 1, device=device, first_seed=5, step=s)[0] for s in range(32)]
    assert by_step[0] == by_seed[0]
    assert len(set(by_step)) >= 29
    assert draws(row, 64, device=device, first_seed=5) == by_seed  # and it replays exactly


def test_mixed_greedy_and_sampled_rows(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 60, generator=gen)
    reqs = [make_req(seed=i, temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(10)]
    got = run(logits, reqs, device).next_token_ids.tolist()
    for i, req in enumerate(reqs):
        if req.params.is_greedy:
            assert got[i] == int(logits[i].argmax())
        else:
            assert got[i] == run(logits[i : i + 1], [req], device).next_token_ids.item()
            assert ref_filtered_probs(logits[i], req.params)[got[i]] > 0


# ---------------------------------------------------------------- logprobs and errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_log_softmax_of_raw_logits(dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 30, generator=gen) * 2).to(dtype)
    reqs = [
        make_req(seed=1, return_logprob=True, top_logprobs_num=5, temperature=0.5),
        make_req(
            seed=2,
            return_logprob=True,
            top_logprobs_num=2,
            repetition_penalty=1.8,
            prompt=[1, 2, 3],
        ),
        make_req(seed=3, temperature=0.0),  # wants none; gets the batch's columns anyway
        make_req(seed=4, return_logprob=True, frequency_penalty=1.0, output=[4, 4]),
    ]
    result = run(logits, reqs, device)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert result.logprobs is not None and result.logprobs.dtype == torch.float32
    chosen = reference.gather(1, result.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(result.logprobs, chosen)
    assert result.top_logprob_ids is not None and result.top_logprob_values is not None
    assert result.top_logprob_ids.shape == (4, 5)
    top = reference.topk(5, dim=-1)
    assert torch.equal(result.top_logprob_ids, top.indices)
    torch.testing.assert_close(result.top_logprob_values, top.values)


def test_no_logprobs_unless_asked() -> None:
    result = run(torch.randn(2, 10), [make_req(seed=1), make_req(temperature=0.0)])
    assert result.logprobs is None and result.top_logprob_ids is None
    only_chosen = run(torch.randn(1, 10), [make_req(return_logprob=True)])
    assert only_chosen.logprobs is not None and only_chosen.top_logprob_ids is None


def test_logits_are_not_modified(device: str) -> None:
    logits = torch.randn(3, 20, device=device)
    before = logits.clone()
    reqs = [
        make_req(repetition_penalty=1.5, prompt=[1, 2], output=[3], frequency_penalty=1.0),
        make_req(stop=frozenset({0}), min_new_tokens=5, top_p=0.5, seed=3),
        make_req(temperature=0.0, top_k=3),
    ]
    sample(logits, SamplingBatch.build(reqs, 20, logits.device))
    assert torch.equal(logits, before)


def test_bad_inputs_raise() -> None:
    batch = SamplingBatch.build([make_req(), make_req()], 10, "cpu")
    with pytest.raises(ValueError, match="shape"):
        sample(torch.randn(3, 10), batch)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.randn(2, 11), batch)
    with pytest.raises(ValueError, match="floating point"):
        sample(torch.zeros(2, 10, dtype=torch.int64), batch)
    with pytest.raises(ValueError, match="no requests"):
        SamplingBatch.build([], 10, "cpu")
    with pytest.raises(ValueError, match="token id 10"):
        SamplingBatch.build([make_req(repetition_penalty=1.2, prompt=[10])], 10, "cpu")
    with pytest.raises(ValueError, match="token id -1"):
        SamplingBatch.build([make_req(stop=frozenset({-1}), min_new_tokens=1)], 10, "cpu")


def test_warm_up_steps_run_every_processor_in_both_batch_forms() -> None:
    """The start-up sampling steps (`sampler._warm_up_steps`: on CUDA they load the
    kernels of each processor before a request needs them) cover penalties on the whole
    batch and on some of its rows, the bias, the stop mask, logprobs, and drawn rows beside
    greedy ones."""
    from radixserve.engine.sampling.sampler import _warm_up_steps

    whole, mixed = _warm_up_steps(64, torch.bfloat16, torch.device("cpu"))
    assert whole.penalties is not None and whole.penalties.rows is None
    assert whole.stop_mask is not None and whole.return_logprob and whole.top_logprobs_num == 5
    assert mixed.penalties is not None and mixed.penalties.rows is not None
    assert mixed.penalties.repetition is not None and mixed.penalties.frequency is not None
    assert mixed.bias is not None and mixed.stop_mask is not None
    assert mixed.sampled is not None and not mixed.sampled.is_whole_batch
    assert mixed.sampled.max_top_k == 5 and mixed.sampled.use_min_p
