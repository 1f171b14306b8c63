"""Mask the logits of constrained rows with their grammars' bitmasks, then sample.

The bitmask (one bit per token, int32 words) is filled on the CPU by each row's
matcher after the previous step's tokens were accepted, copied to the logits'
device, and applied there with xgrammar's own kernel (CPU, CUDA or Triton, chosen
by xgrammar for the device): disallowed tokens get -inf before penalties,
temperature and top-k/p, so every sampled token is one the grammar admits.
Unconstrained rows are left alone (the kernel takes the constrained row indices),
so a mixed batch samples them exactly as an unconstrained batch would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from radixserve.engine.sampling.sampler import SampleResult, sample

if TYPE_CHECKING:
    from radixserve.engine.request import Req
    from radixserve.engine.sampling.batch import SamplingBatch


def warm_up(vocab_size: int, device: torch.device) -> None:
    """Build xgrammar's mask kernel for this device now rather than in the first
    constrained step (on CUDA a Triton kernel, compiled at its first use: a stall of the
    whole batch). Its variants are by the number of constrained rows (Triton specializes
    an integer argument equal to 1, and one divisible by 16): 1, 2 and 16 rows."""
    if device.type != "cuda":
        return
    import xgrammar as xgr

    for rows in (1, 2, 16):
        logits = torch.zeros(rows, vocab_size, device=device)
        bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(device), vocab_size=vocab_size, indices=list(range(rows))
        )


def sample_with_grammar(
    logits: torch.Tensor, sampling: SamplingBatch, reqs: Sequence[Req]
) -> SampleResult:
    """`sample`, with the grammar rows masked. `logits` [bs, vocab] is consumed: the
    scheduler passes the rows it just gathered, which nothing else reads."""
    rows = [row for row, req in enumerate(reqs) if req.grammar is not None]
    if not rows:
        return sample(logits, sampling)
    import xgrammar as xgr

    masked = logits.float()  # xgrammar's CPU kernel reads float32 only
    raw = masked.clone() if sampling.return_logprob else None
    bitmask = xgr.allocate_token_bitmask(len(reqs), sampling.vocab_size)
    for row in rows:
        state = reqs[row].grammar
        assert state is not None
        state.fill_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(
        masked,
        bitmask.to(masked.device, non_blocking=True),
        vocab_size=sampling.vocab_size,
        indices=rows,
    )
    result = sample(masked, sampling)
    if raw is None:
        return result
    return _with_raw_logprobs(result, raw, min(sampling.top_logprobs_num, sampling.vocab_size))


def _with_raw_logprobs(result: SampleResult, raw: torch.Tensor, top_k: int) -> SampleResult:
    """Logprobs of the model's own distribution (before the grammar mask), the sampler's
    definition: the mask decides what may be sampled, not what the model thought."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, result.next_token_ids.unsqueeze(1)).squeeze(1)
    if top_k <= 0:
        return replace(result, logprobs=chosen)
    top = logprobs.topk(top_k, dim=-1)
    return replace(
        result, logprobs=chosen, top_logprob_ids=top.indices, top_logprob_values=top.values
    )
