"""The sampler's draw in one kernel: temperature, top-k, top-p, min-p and the seeded
inverse-CDF draw of each sampled row, over its logits in a few passes and no sort.

One program per row; it streams the row's logits block by block, keeping per-lane
partial sums and reducing them once a pass. The semantics are the
torch sampler's (`sampling/sampler.py`), computed in logit space: y = logits /
temperature, e = exp(y - max y) (the probabilities up to the softmax's common factor).

- top-k keeps every token with y at least the k-th largest y (ties at the border kept).
- top-p, of what top-k kept, in descending order with ties ordered by token id, keeps a
  token while the mass before it is <= top_p x the kept mass: the border value v is the
  largest y whose mass at or above it exceeds top_p x kept; every token above v is kept
  and, of the tokens equal to v, the first r by token id, where r is the number whose
  mass before stays within bound.
- min-p drops e < min_p (the largest e is exactly 1).
- The draw: the first kept token, in token-id order, whose running kept mass exceeds
  u x the kept total; never a removed or zero-mass token.

The k-th largest value and the top-p border are found by a search over the row's
values: each pass counts (or sums the mass of) the elements at or above RADIX thresholds
at once and narrows the range to one bucket, until a bucket holds one distinct value
(a few passes on real logits, whose values sit at 16-bit spacing). The last pass stores
each block's kept mass, so the draw reads only the block where the running mass passes
the target. Sums run in an order fixed by the vocabulary size alone, so a row draws the
same token in any batch. The results equal the sort-based torch path's except where
float rounding of the two sums' orders differs (a draw within rounding of a border).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_y(X, offs, V: tl.constexpr, inv_t):
    x = tl.load(X + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x * inv_t


@triton.jit
def _next_up(x):
    """The smallest float32 above finite x."""
    bits = x.to(tl.int32, bitcast=True)
    up = tl.where(x == 0.0, 1, tl.where(x > 0.0, bits + 1, bits - 1))
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _search(
    X,
    inv_t,
    row_max,
    lo,
    floor,
    target,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    RADIX: tl.constexpr,
    BY_MASS: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    """The largest y v of the row with S(v) > target, where S(t) is the count (or, with
    BY_MASS, the mass e) of the elements with y >= max(t, floor); the caller guarantees
    S(lo) > target (v is then in [lo, row_max]).

    Each pass splits the range [lo, hi) holding v at RADIX thresholds, sums S at each
    and keeps the bucket of the highest one still above target; it also finds the
    smallest and largest y in the range, which tighten it, and when they are equal that
    value is v (S only drops at values of the row). A few passes on real logits;
    MAX_PASSES bounds pathological rows (the range's lowest value then stands in)."""
    js = tl.arange(0, RADIX)
    hi = _next_up(row_max)
    passes = 0
    while (lo < hi) & (passes < MAX_PASSES):
        width = (hi - lo) / RADIX
        cands = tl.where(js == 0, lo, lo + js.to(tl.float32) * width)
        # Per-lane accumulators, reduced once after the pass.
        acc = tl.zeros([RADIX, BLOCK], dtype=tl.float32)
        low = tl.full([BLOCK], float("inf"), tl.float32)
        high = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = _load_y(X, offs, V, inv_t)
            if BY_MASS:
                w = tl.exp(y - row_max)
            else:
                w = tl.full([BLOCK], 1.0, tl.float32)
            w = tl.where(y >= floor, w, 0.0)
            acc += tl.where(y[None, :] >= cands[:, None], w[None, :], 0.0)
            inside = (y >= lo) & (y < hi)
            low = tl.minimum(low, tl.where(inside, y, float("inf")))
            high = tl.maximum(high, tl.where(inside, y, float("-inf")))
        sums = tl.sum(acc, axis=1)
        least = tl.min(low, axis=0)
        most = tl.max(high, axis=0)
        pick = tl.max(tl.where(sums > target, js, 0), axis=0)
        new_lo = tl.max(tl.where(js == pick, cands, float("-inf")), axis=0)
        new_hi = tl.min(tl.where(js == pick + 1, cands, hi), axis=0)
        # One value left in the range: it is v (the loop ends with lo == hi).
        lo = tl.where(least == most, least, tl.maximum(new_lo, least))
        hi = tl.where(least == most, least, tl.minimum(new_hi, _next_up(most)))
        passes += 1
    return lo


@triton.jit
def _mass_at_or_above(X, inv_t, row_max, floor, V: tl.constexpr, BLOCK: tl.constexpr):
    """The mass e of the row's y >= floor."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = _load_y(X, offs, V, inv_t)
        total += tl.where(y >= floor, tl.exp(y - row_max), 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _kept(y, offs, V: tl.constexpr, e, floor, border, ties_before, ties_kept, min_p):
    """Kept mask of a block: at or above the top-k floor, above the top-p border (or
    among the first `ties_kept` tokens equal to it: `ties_before` counts those in earlier
    blocks), not below min-p; and the block's tokens equal to the border."""
    is_tie = (y == border) & (offs < V)
    rank = ties_before + tl.cumsum(is_tie.to(tl.int32), axis=0) - 1
    kept = (y >= floor) & ((y > border) | (is_tie & (rank < ties_kept)))
    return kept & (e >= min_p) & (offs < V), is_tie


# The per-row parameters are columns of one upload (sampling/batch.py) at any offset:
# not specializing on their alignment keeps one compile (the warm-up's) for them all.
@triton.jit(
    do_not_specialize_on_alignment=[
        "Rows",
        "Temperatures",
        "TopKs",
        "TopPs",
        "MinPs",
        "Uniforms",
    ]
)
def _draw_kernel(
    Logits,
    stride,
    Rows,
    Temperatures,
    TopKs,
    TopPs,
    MinPs,
    Uniforms,
    Scratch,
    Out,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    RADIX: tl.constexpr,
    FILTERED: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    pid = tl.program_id(0)
    X = Logits + tl.load(Rows + pid).to(tl.int64) * stride
    inv_t = 1.0 / tl.load(Temperatures + pid)

    # Pass 1: the largest y, the smallest finite one and how many are finite.
    vmax = tl.full([BLOCK], float("-inf"), tl.float32)
    vmin = tl.full([BLOCK], float("inf"), tl.float32)
    vfinite = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = _load_y(X, offs, V, inv_t)
        is_finite = y > float("-inf")
        vmax = tl.maximum(vmax, y)
        vmin = tl.minimum(vmin, tl.where(is_finite, y, float("inf")))
        vfinite += is_finite.to(tl.float32)
    row_max = tl.max(vmax, axis=0)
    row_min = tl.min(vmin, axis=0)
    finite = tl.sum(vfinite, axis=0)

    # The filters are switched per row, by value: top-k off is k = V, top-p off any
    # p >= 1, min-p off 0. FILTERED is off for a batch with none on any row (the common
    # temperature-only batch: a leaner kernel); else one kernel serves every mix.
    floor = float("-inf")  # no top-k floor
    border = float("-inf")  # no top-p border: every token from the floor up is kept
    ties_kept = 0
    min_p = 0.0
    if FILTERED:
        # top-k: the k-th largest y is the largest t with count(y >= t) > k - 1 (-inf
        # when fewer than k tokens are finite: then the zero-mass ones are kept too).
        k = tl.load(TopKs + pid).to(tl.float32)
        if k <= finite - 1.0:
            floor = _search(
                X, inv_t, row_max, row_min, floor, k - 1.0, V, BLOCK, RADIX, False, MAX_PASSES
            )
        top_p = tl.load(TopPs + pid)
        if top_p < 1.0:
            kept_mass = _mass_at_or_above(X, inv_t, row_max, floor, V, BLOCK)
            bound = top_p * kept_mass
            if kept_mass > bound:
                # The border's e is at least (1 - top_p) x kept / V (the tokens at or
                # below it hold the rest of the mass): start there, a unit below for
                # rounding.
                lowest = row_max + tl.log((1.0 - top_p) * kept_mass / V) - 1.0
                lo = tl.maximum(tl.maximum(lowest, floor), row_min)
                border = _search(
                    X, inv_t, row_max, lo, floor, bound, V, BLOCK, RADIX, True, MAX_PASSES
                )
                # Mass strictly above the border (and at or above the floor, below it).
                above = _mass_at_or_above(X, inv_t, row_max, _next_up(border), V, BLOCK)
                # Tie j (0-based, by token id) has mass before = above + j x e(border).
                ratio = (bound - above) / tl.exp(border - row_max)
                ties_kept = (tl.floor(tl.minimum(tl.maximum(ratio, -1.0), V)) + 1.0).to(tl.int32)
        min_p = tl.load(MinPs + pid)

    # Each block's kept mass and border ties, kept in Scratch [m, 2, NUM_BLOCKS]; then
    # the draw reads only the block where the running mass passes the target.
    sums = Scratch + pid * 2 * NUM_BLOCKS
    ties = 0
    for b in range(0, tl.cdiv(V, BLOCK)):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        y = _load_y(X, offs, V, inv_t)
        e = tl.exp(y - row_max)
        kept, is_tie = _kept(y, offs, V, e, floor, border, ties, ties_kept, min_p)
        n_ties = tl.sum(is_tie.to(tl.int32), axis=0)
        ties += n_ties
        tl.store(sums + b, tl.sum(tl.where(kept, e, 0.0), axis=0))
        tl.store(sums + NUM_BLOCKS + b, n_ties.to(tl.float32))
    # Other threads of the program stored those sums: wait for every store.
    tl.debug_barrier()
    bs = tl.arange(0, NUM_BLOCKS)
    valid = bs < tl.cdiv(V, BLOCK)
    block_mass = tl.load(sums + bs, mask=valid, other=0.0)
    block_ties = tl.load(sums + NUM_BLOCKS + bs, mask=valid, other=0.0)
    cumulative = tl.cumsum(block_mass, axis=0)
    target = tl.load(Uniforms + pid) * tl.sum(block_mass, axis=0)
    # The first block whose cumulative mass passes the target; rounding may leave none
    # (the target at the total): then the last block with mass.
    crossing = tl.min(tl.where((cumulative > target) & (block_mass > 0.0), bs, NUM_BLOCKS))
    last = tl.max(tl.where(block_mass > 0.0, bs, 0))
    b = tl.where(crossing < NUM_BLOCKS, crossing, last)
    before = tl.sum(tl.where(bs < b, block_mass, 0.0), axis=0)
    ties_before = tl.sum(tl.where(bs < b, block_ties, 0.0), axis=0).to(tl.int32)

    offs = b * BLOCK + tl.arange(0, BLOCK)
    y = _load_y(X, offs, V, inv_t)
    e = tl.exp(y - row_max)
    kept, _ = _kept(y, offs, V, e, floor, border, ties_before, ties_kept, min_p)
    mass = tl.where(kept, e, 0.0)
    cdf = before + tl.cumsum(mass, axis=0)
    picked = tl.min(tl.where((cdf > target) & (mass > 0.0), offs, V), axis=0)
    last_kept = tl.max(tl.where(mass > 0.0, offs, 0), axis=0)
    tl.store(Out + pid, tl.where(picked < V, picked, last_kept).to(tl.int64))


# Launch choices, from a sweep on the H100 (`bench/sampling.py --sweep`).
BLOCK = 8192
RADIX = 4
NUM_WARPS = 16
MAX_PASSES = 24


def draw_triton(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    filtered: bool = True,
) -> torch.Tensor:
    """[m] int64: the token drawn for each of `rows` of `logits` [bs, vocab] (any float
    dtype, last dim contiguous); the per-row parameters are [m] or [m, 1] tensors
    (top_ks int64, the others float32) on the logits' device. A filter is off for a row
    where its value says so: top-k >= vocab, top-p >= 1, min-p 0; `filtered=False`
    (every row has every filter off) takes the leaner temperature-only kernel."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("draw_triton needs 2-D logits with a contiguous last dim")
    m = rows.numel()
    out = torch.empty(m, dtype=torch.int64, device=logits.device)
    if m == 0:
        return out
    vocab = logits.shape[1]
    num_blocks = triton.next_power_of_2(triton.cdiv(vocab, BLOCK))
    scratch = torch.empty(m, 2, num_blocks, dtype=torch.float32, device=logits.device)
    _draw_kernel[(m,)](
        logits,
        logits.stride(0),
        rows,
        temperatures,
        top_ks,
        top_ps,
        min_ps,
        uniforms,
        scratch,
        out,
        V=vocab,
        BLOCK=BLOCK,
        NUM_BLOCKS=num_blocks,
        RADIX=RADIX,
        FILTERED=filtered,
        MAX_PASSES=MAX_PASSES,
        num_warps=NUM_WARPS,
    )
    return out
