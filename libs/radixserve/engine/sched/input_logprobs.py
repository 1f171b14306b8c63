"""Prompt logprobs (`return_logprob` with `logprob_start_len` >= 0): which rows of a
step's flattened tokens must give the logprob of the prompt token after them, and the
results back onto their requests.

The token at prompt position j is scored by the query at j - 1. A request's radix match
stops before its first such query (KVManager.match), so every query due is computed in
one of its prefill's chunks; each chunk scores the positions it covers and moves
`Req.input_logprob_next` on. A retracted request that prefills again scores nothing
twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.request import Req, TokenLogprob


@dataclass(frozen=True)
class InputLogprobPlan:
    rows: list[int]  # flat token indices of the step's batch (the queries)
    targets: list[int]  # the prompt token each query scores
    owners: list[tuple[Req, int]]  # in row order: each request and how many rows it has
    top: int  # top logprobs per row (the largest a request asked for)


def plan_input_logprobs(reqs: list[Req]) -> InputLogprobPlan | None:
    """The step's rows that score prompt tokens (before the forward: kv_len and
    extend_len are the step's); advances each request's `input_logprob_next`."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Req, int]] = []
    top = 0
    offset = 0
    for req in reqs:
        due = req.input_logprob_next
        if due > 0:
            prompt = req.origin_input_ids
            # Queries at positions [kv_len, kv_len + extend_len) score tokens q + 1.
            first = max(due, req.kv_len + 1)
            end = min(req.kv_len + req.extend_len + 1, len(prompt))
            if first < end:
                rows.extend(range(offset + first - 1 - req.kv_len, offset + end - 1 - req.kv_len))
                targets.extend(prompt[first:end])
                owners.append((req, end - first))
                top = max(top, req.params.top_logprobs_num)
                req.input_logprob_next = end if end < len(prompt) else -1
        offset += req.extend_len
    if not rows:
        return None
    return InputLogprobPlan(rows, targets, owners, top)


def assign_input_logprobs(
    plan: InputLogprobPlan,
    logprobs: torch.Tensor,
    top_ids: torch.Tensor | None,
    top_values: torch.Tensor | None,
) -> None:
    """Append each request's scored prompt tokens (host tensors, in plan order)."""
    chosen = logprobs.tolist()
    ids = top_ids.tolist() if top_ids is not None else None
    values = top_values.tolist() if top_values is not None else None
    row = 0
    for req, count in plan.owners:
        k = req.params.top_logprobs_num
        for i in range(row, row + count):
            entry = TokenLogprob(token_id=plan.targets[i], logprob=chosen[i])
            if k > 0 and ids is not None and values is not None:
                entry.top = list(zip(ids[i][:k], values[i][:k], strict=True))
            req.input_logprobs.append(entry)
        row += count
