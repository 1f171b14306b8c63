"""Cases for the sampler's Triton draw against the torch sampler's sort-based draw,
shared by the interpreter tests (tests/unit) and the compiled ones (tests/gpu), and for
its greedy rows' argmax.

The two sum the kept masses in different orders, so on continuous logits a pick may
differ only where the reference's target lies within rounding of the border between
the two picks; `assert_same_draws` allows exactly that and nothing else.
"""

from __future__ import annotations

import torch

from radixserve.engine.sampling import sampler
from radixserve.engine.sampling.batch import SampledRows


def make_rows(
    device: torch.device,
    vocab: int,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniforms: list[float],
) -> SampledRows:
    """Rows as `SamplingBatch.build` makes them (top-k 0 or >= vocab and top-p 1: off)."""

    def col(values: list[float] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    ks = [k if 0 < k < vocab else vocab for k in top_k]
    return SampledRows(
        rows=torch.arange(len(ks), device=device),
        is_whole_batch=True,
        temperatures=col(temperature),
        top_ks=col(ks, torch.int64),
        top_ps=col([p if p < 1.0 else float("inf") for p in top_p]),
        min_ps=col(min_p),
        uniforms=col(uniforms),
        max_top_k=max((k for k in ks if k < vocab), default=0),
        use_top_p=any(p < 1.0 for p in top_p),
        use_min_p=any(p > 0.0 for p in min_p),
    )


def kernel(logits: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    """The Triton draw, as the sampler calls it on CUDA."""
    return sampler._draw_triton(logits, rows)


def reference_kept(logits: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    """The torch sampler's kept probabilities (removed tokens at 0), float64, on the CPU."""
    probs = torch.softmax(logits.float() / rows.temperatures, dim=-1)
    removed = sampler._removed_tokens(probs, rows)
    if removed is not None:
        probs = probs.masked_fill(removed, 0.0)
    return probs.double().cpu()


def assert_same_draws(logits: torch.Tensor, rows: SampledRows) -> int:
    """Kernel picks equal the torch sampler's but where rounding decides; never a removed
    token. Returns how many rows differed (within rounding)."""
    got = kernel(logits, rows).cpu()
    want = sampler._draw(logits.float(), rows).cpu()
    kept = reference_kept(logits, rows)
    cdf = kept.cumsum(dim=-1)
    target = rows.uniforms.cpu().double() * cdf[:, -1:]
    differ = torch.nonzero(got != want).flatten().tolist()
    for r in differ:
        lo, hi = sorted((int(got[r]), int(want[r])))
        # Every cdf step between the two picks must sit within rounding of the target.
        steps = cdf[r, lo:hi]
        gap = float((steps - target[r, 0]).abs().max()) / float(cdf[r, -1])
        assert gap < 1e-5, f"row {r}: kernel {int(got[r])}, reference {int(want[r])} ({gap})"
    assert bool((kept.gather(1, got.unsqueeze(1)) > 0).all()), "a removed token was drawn"
    return len(differ)


def random_case(
    m: int, vocab: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, SampledRows]:
    """Normal logits at varied scales; every filter on in some rows and off in others."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 + 4.0 * torch.rand(m, 1, generator=g)
    logits = torch.randn(m, vocab, generator=g) * scale
    choice = torch.rand(m, 4, generator=g)
    temperature = (0.3 + 1.5 * choice[:, 0]).tolist()
    top_k = [int(k) for k in torch.randint(1, vocab + 40, (m,), generator=g)]
    top_p = [0.05 + 0.95 * float(p) if p < 0.8 else 1.0 for p in choice[:, 1]]
    min_p = [0.2 * float(p) if p < 0.5 else 0.0 for p in choice[:, 2]]
    uniforms = torch.rand(m, generator=g).clamp(1e-6, 1 - 1e-6).tolist()
    rows = make_rows(device, vocab, temperature, top_k, top_p, min_p, uniforms)
    return logits.to(device), rows


def assert_tied_borders(logits: torch.Tensor, top_k: int, top_p: float) -> None:
    """On logits with many ties, the kept set equals the torch sampler's: the draws at u
    near 0 and near 1 are its first and last kept token by token id. The last may differ
    by a tie at the top-p border only where the mass before that tie lies within float32
    rounding of the bound (the two paths sum in different orders)."""
    m, vocab = logits.shape
    for u in (1e-7, 1 - 1e-7):
        rows = make_rows(
            logits.device, vocab, [1.0] * m, [top_k] * m, [top_p] * m, [0.0] * m, [u] * m
        )
        got = kernel(logits, rows).cpu()
        kept = reference_kept(logits, rows) > 0
        ids = torch.arange(vocab).expand(m, -1)
        first = torch.where(kept, ids, vocab).amin(dim=-1)
        last = torch.where(kept, ids, -1).amax(dim=-1)
        want = first if u < 0.5 else last
        for r in torch.nonzero(got != want).flatten().tolist():
            assert u > 0.5, (u, r, got, want)
            _assert_border_within_rounding(logits[r].cpu(), top_k, top_p, int(got[r]), int(want[r]))


def _assert_border_within_rounding(
    logits: torch.Tensor, top_k: int, top_p: float, a: int, b: int
) -> None:
    """Tokens a and b are ties at the top-p border, and the later one's mass before it (in
    float64, ties ordered by id) is within 1e-5 of top_p x the top-k-kept mass."""
    assert logits[a] == logits[b], f"{a} and {b} are not tied"
    p = torch.softmax(logits.double(), dim=-1)
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        p = torch.where(logits >= kth, p, 0.0)
    later = max(a, b)
    ids = torch.arange(logits.numel())
    before = p[(logits > logits[later]) | ((logits == logits[later]) & (ids < later))].sum()
    bound = top_p * p.sum()
    assert abs(float(before - bound)) <= 1e-5 * float(p.sum()), (a, b, float(before), float(bound))


def argmax_cases(vocab: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Logits where the first index decides an argmax: random rows, ties (three distinct
    values), one finite value among -inf (at either end), NaNs scattered, signed zeros,
    a row of -inf, +inf before a NaN."""
    g = torch.Generator().manual_seed(0)
    lone = torch.full((2, vocab), float("-inf"))
    lone[0, vocab - 1] = 1.0
    lone[1, 0] = -1.0
    nans = torch.randn(3, vocab, generator=g)
    nans[:, torch.randint(0, vocab, (4,), generator=g)] = float("nan")
    # Signed zeros compare equal (the first wins), and the largest values are -inf in
    # one row, +inf ahead of a later NaN in another.
    edges = torch.full((3, vocab), float("-inf"))
    edges[0, vocab // 3] = -0.0
    edges[0, vocab // 2] = 0.0
    edges[2, 1] = float("inf")
    edges[2, vocab - 1] = float("nan")
    cases = {
        "random": torch.randn(5, vocab, generator=g),
        "ties": torch.randint(0, 3, (5, vocab), generator=g).float(),
        "lone": lone,
        "nans": nans,
        "edges": edges,
    }
    return {name: t.to(device=device, dtype=dtype) for name, t in cases.items()}
