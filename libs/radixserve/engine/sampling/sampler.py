"""Choose the next token of every row of a batch from its logits.

Order of operations (all in float32, all batched over rows):

1. Penalties, on every row: repetition (HF-style over prompt + output tokens: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency (minus
   penalty x count in the output) and presence (minus penalty if in the output).
   Then `logit_bias` (OpenAI's): each row's values added to its tokens' logits.
2. min_new_tokens: a row with fewer outputs than that gets -inf on its stop ids
   (eos unless ignore_eos, plus stop_token_ids).
3. Greedy rows (temperature ~ 0 or top_k == 1) take the argmax (first index on ties).
4. Sampled rows: divide by the temperature, softmax, then drop tokens outside top-k
   (every token at least as probable as the k-th one: ties at the border are kept), then
   outside top-p (of the distribution left by top-k, in descending probability, ties
   ordered by token id, keep a token while the mass before it is <= top_p), then below
   min_p x the largest probability. Draw by inverse CDF over the kept probabilities, in
   token-id order, with the row's uniform from `noise.row_uniforms(seed, output position)`.

On CUDA (with triton) steps 3-4's sampled rows run as one kernel,
`kernels/triton_ops/sampling.py`, with these semantics and no sort; elsewhere as the
torch ops below. The two agree except where float rounding of their sums, taken in
different orders, decides a draw at a border.

Why inverse CDF rather than Gumbel-max: it needs one random number per row instead of a
[bs, vocab] noise tensor, and the draw is still a pure function of (seed, position) and
the row's own logits, so a request samples the same tokens alone or in any batch.

Logprobs are `log_softmax` of the RAW logits (before penalties, masks and temperature):
the model's own distribution, comparable across requests whatever their sampling settings
(SGLang's default). The chosen token's logprob and the top-k (k = the batch's largest
top_logprobs_num; a row that asked for fewer ignores the extra columns) come back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixserve.engine.kernels import dispatch
from radixserve.engine.sampling.batch import SampledRows, SamplingBatch, SamplingRequest
from radixserve.engine.sampling.params import SamplingParams, resolve_seed
from radixserve.engine.sampling.penalty_state import MIN_ROWS, PenaltyState

__all__ = ["SampleResult", "resolve_seed", "sample", "warm_up"]


@dataclass(frozen=True)
class SampleResult:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None = None  # [bs] float32: each chosen token's logprob
    top_logprob_ids: torch.Tensor | None = None  # [bs, k] int64
    top_logprob_values: torch.Tensor | None = None  # [bs, k] float32


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Next token per row; `logits` [bs, vocab] of any float dtype, left unmodified."""
    _check_logits(logits, batch)
    if (
        batch.penalties is None
        and batch.bias is None
        and batch.stop_mask is None
        and batch.sampled is None
        and not batch.return_logprob
    ):
        # All greedy: the argmax of 16-bit logits is that of their exact float32 copy.
        return SampleResult(next_token_ids=argmax_rows(logits))
    # The draw reads 16-bit logits as they are (their float32 values are exact); the
    # penalties, the stop mask and the logprobs need one float32 copy.
    needs_float = (
        batch.penalties is not None
        or batch.bias is not None
        or batch.stop_mask is not None
        or batch.return_logprob
    )
    raw = logits.float() if needs_float else logits
    processed = raw
    if batch.penalties is not None:
        processed = batch.penalties.apply(processed)
    if batch.bias is not None:
        processed = batch.bias.apply(processed)
    if batch.stop_mask is not None:
        processed = batch.stop_mask.apply(processed)
    next_ids = _choose(processed, batch.sampled)
    if not batch.return_logprob:
        return SampleResult(next_token_ids=next_ids)
    return _with_logprobs(raw, next_ids, min(batch.top_logprobs_num, batch.vocab_size))


def _choose(logits: torch.Tensor, sampled: SampledRows | None) -> torch.Tensor:
    if sampled is None:
        return argmax_rows(logits)
    if dispatch.use_triton(logits):
        drawn = _draw_triton(logits, sampled)  # reads the sampled rows in place
    elif sampled.is_whole_batch:
        drawn = _draw(logits, sampled)
    else:
        drawn = _draw(logits.index_select(0, sampled.rows), sampled)
    if sampled.is_whole_batch:
        return drawn
    return argmax_rows(logits).index_copy(0, sampled.rows, drawn)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[bs] int64: each row's argmax, the first index on ties (and the first NaN), as
    `logits.argmax(dim=-1)`: on CUDA in two Triton kernels (kernels/triton_ops/argmax.py:
    the vocabulary spread over rows x blocks programs, where torch's reduce gives a row
    to one block of threads)."""
    if dispatch.use_triton(logits) and logits.stride(-1) == 1:
        from radixserve.engine.kernels.triton_ops.argmax import argmax_triton

        return argmax_triton(logits)
    return logits.argmax(dim=-1)


def _draw_triton(logits: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    from radixserve.engine.kernels.triton_ops.sampling import draw_triton

    return draw_triton(
        logits,
        rows.rows,
        rows.temperatures,
        rows.top_ks,
        rows.top_ps,
        rows.min_ps,
        rows.uniforms,
        filtered=rows.max_top_k > 0 or rows.use_top_p or rows.use_min_p,
    )


def warm_up(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the sampling kernels now, for logits of the model's `dtype` and of float32
    (what penalties write), rather than in the first step that needs them (a stall of a
    second or more for the whole batch): the greedy argmax's two kernels, and the draw
    kernel's two variants, temperature only and any filters, each on rows built as every
    step builds them. Then a few whole steps load the torch kernels of the other
    processors (`_warm_up_steps`)."""
    probe = torch.zeros(1, vocab_size, device=device)
    if not dispatch.use_triton(probe):
        return
    variants = []
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.5, top_p=0.5)):
        rows = SamplingBatch.build([SamplingRequest(params, seed=0)], vocab_size, device).sampled
        assert rows is not None  # a temperature above 0 is sampled
        variants.append(rows)
    for logits_dtype in dict.fromkeys((dtype, torch.float32)):
        logits = probe.to(logits_dtype)
        argmax_rows(logits)
        for rows in variants:
            _draw_triton(logits, rows)
    _warm_up_steps(vocab_size, dtype, device)


def _warm_up_steps(
    vocab_size: int, dtype: torch.dtype, device: torch.device
) -> list[SamplingBatch]:
    """Run whole sampling steps of every processor once (the batches, returned): penalties
    (kept in a `PenaltyState`, as the engine keeps them) on the whole batch and on some
    rows, a logit bias, a stop mask, logprobs, drawn rows beside greedy ones. On CUDA
    torch loads each kernel at its first launch (lazy module loading): without this the
    first request of each kind waited for those loads (measured:
    lab/notebook/2026-11-28-h200-first-requests-each-kind-after.md)."""
    biased = SamplingParams(temperature=0.0, logit_bias={0: 1.0})
    penalized = SamplingParams(
        temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
    )
    processed = replace(penalized, min_new_tokens=2, return_logprob=True, top_logprobs_num=5)
    drawn = replace(penalized, temperature=0.5, top_k=5, min_p=0.1)
    state = PenaltyState(vocab_size, device, max_rows=MIN_ROWS)
    batches = []
    for batch_params in ((processed,), (biased, processed, drawn)):
        reqs = [
            SamplingRequest(p, 0, origin_input_ids=(0, 1), output_ids=(1,), stop_token_ids={0})
            for p in batch_params
        ]
        batch = SamplingBatch.build(reqs, vocab_size, device, state)
        logits = torch.zeros(len(reqs), vocab_size, dtype=dtype, device=device)
        state.accept(batch.penalties, sample(logits, batch).next_token_ids)
        for req in reqs:
            state.release(req)
        batches.append(batch)
    return batches


def _draw(logits: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    probs = torch.softmax(logits / rows.temperatures, dim=-1)
    removed = _removed_tokens(probs, rows)
    if removed is not None:
        probs = probs.masked_fill(removed, 0.0)
    cdf = probs.cumsum(dim=-1)
    # u < 1 keeps the target strictly below the total, so cdf[i-1] <= target < cdf[i]
    # picks a token with positive probability.
    target = rows.uniforms * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # A parallel cumsum may round to a non-monotone cdf; never return a removed token.
    ok = probs.gather(1, picked) > 0
    picked = torch.where(ok, picked, probs.argmax(dim=-1, keepdim=True))
    return picked.squeeze(1)


def _removed_tokens(probs: torch.Tensor, rows: SampledRows) -> torch.Tensor | None:
    """[m, vocab] bool: tokens that top-k, top-p or min-p take out; None if none can."""
    removed: torch.Tensor | None = None
    if rows.needs_sort:
        removed = _top_k_top_p_sorted(probs, rows)
    elif rows.max_top_k > 0:
        top = probs.topk(rows.max_top_k, dim=-1).values
        kth = top.gather(1, (rows.top_ks - 1).clamp(max=rows.max_top_k - 1))
        kth = kth.masked_fill(rows.top_ks >= probs.shape[-1], 0.0)  # top-k off: keep all
        removed = probs < kth
    if rows.use_min_p:
        # The largest probability survives top-k and top-p, so this threshold is the
        # same before or after their renormalization.
        low = probs < probs.amax(dim=-1, keepdim=True) * rows.min_ps
        removed = low if removed is None else removed | low
    return removed


def _top_k_top_p_sorted(probs: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    """[m, vocab] bool: what top-k and top-p take out, decided in each row's stable
    descending order (ties ordered by token id, so the kept set is a function of the row
    alone). On the CPU, where a branch costs nothing, each row is first decided among its
    most probable tokens (a partial sort, ~25x cheaper than sorting the vocabulary); a
    row whose border lies outside them looks among more, then is sorted whole."""
    # top-k off: k = vocab, whose threshold (the row's least probability) removes nothing.
    if probs.is_cuda:
        return _removed_by_full_sort(probs, rows.top_ks, rows.top_ps)
    return _removed_on_cpu(probs, rows.top_ks, rows.top_ps, CANDIDATES)


# How many of a row's most probable tokens the CPU looks among first; rows left
# undecided look among 8x as many, then sort whole.
CANDIDATES = (256, 2048)


def _removed_on_cpu(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, tiers: tuple[int, ...]
) -> torch.Tensor:
    if not tiers or probs.shape[-1] <= 2 * tiers[0]:
        return _removed_by_full_sort(probs, top_ks, top_ps)
    removed, decided = _removed_among_candidates(probs, top_ks, top_ps, tiers[0])
    if bool(decided.all()):
        return removed
    undecided = (~decided).nonzero().squeeze(1)
    rest = _removed_on_cpu(
        probs.index_select(0, undecided),
        top_ks.index_select(0, undecided),
        top_ps.index_select(0, undecided),
        tiers[1:],
    )
    return removed.index_copy(0, undecided, rest)


def _removed_in_order(
    sorted_probs: torch.Tensor, kth: torch.Tensor, top_ps: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """Over a row's leading positions in stable descending order: below the k-th
    probability, or with more than top_p x `total` (the mass top-k kept) before it."""
    removed = sorted_probs < kth
    kept = sorted_probs.masked_fill(removed, 0.0)
    cumulative = kept.cumsum(dim=-1)
    # top-p of the top-k distribution: the mass before a token against top_p x kept.
    return removed | (cumulative - kept > top_ps * total)


def _kept_mass(probs: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """[m, 1] the mass top-k keeps, summed in token-id order: both paths below use it, so
    a row decides alike whichever path it takes."""
    return probs.masked_fill(probs < kth, 0.0).sum(dim=-1, keepdim=True)


def _removed_by_full_sort(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    kth = sorted_probs.gather(1, top_ks - 1)
    removed = _removed_in_order(sorted_probs, kth, top_ps, _kept_mass(probs, kth))
    return torch.zeros_like(removed).scatter_(1, order, removed)


def _removed_among_candidates(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(removed [m, vocab], decided [m]): each row's decision from its n most probable
    tokens, and whether that decision is the full sort's.

    The candidates sorted by (probability descending, token id) agree with the full
    stable sort on every position holding more than the least candidate's probability
    (the certain prefix); at that least value, ties may lie outside. A row is decided
    when its kept set sits inside the certain prefix: its top-k threshold is above the
    least candidate, or (top-k off) its top-p border falls within the prefix."""
    vocab = probs.shape[-1]
    values, ids = probs.topk(n, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    least = values[:, -1:]
    top_k_on = top_ks < vocab
    kth = torch.where(
        top_k_on, values.gather(1, (top_ks - 1).clamp(max=n - 1)), torch.zeros_like(least)
    )
    removed_sorted = _removed_in_order(values, kth, top_ps, _kept_mass(probs, kth))
    certain = values > least
    # top-p's removals are a suffix of the order: the border is inside the certain prefix
    # when some certain position is removed.
    border_inside = (removed_sorted & certain).any(dim=-1, keepdim=True)
    keep_all = ~top_k_on & torch.isinf(top_ps)
    decided = keep_all | (top_k_on & (kth > least)) | (~top_k_on & border_inside)
    removed = torch.ones_like(probs, dtype=torch.bool).scatter_(1, ids, removed_sorted)
    removed = removed & ~keep_all
    return removed, decided.squeeze(1)


def _with_logprobs(raw: torch.Tensor, next_ids: torch.Tensor, top_k: int) -> SampleResult:
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    if top_k <= 0:
        return SampleResult(next_token_ids=next_ids, logprobs=chosen)
    top = logprobs.topk(top_k, dim=-1)
    return SampleResult(
        next_token_ids=next_ids,
        logprobs=chosen,
        top_logprob_ids=top.indices,
        top_logprob_values=top.values,
    )


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    expected = (batch.batch_size, batch.vocab_size)
    if logits.dim() != 2 or tuple(logits.shape) != expected:
        raise ValueError(f"logits have shape {tuple(logits.shape)}; the batch expects {expected}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    have, want = logits.device, batch.device
    if have.type != want.type or (
        have.index is not None and want.index is not None and have.index != want.index
    ):
        raise ValueError(f"logits are on {have}; the sampling batch was built on {want}")
