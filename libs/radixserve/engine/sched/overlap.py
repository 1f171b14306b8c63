"""Overlap scheduling (SGLang's zero-overhead scheduler), the pieces the scheduler uses.

With overlap on, a step launches its forward and sampling, then reads the PREVIOUS
step's sampled ids (already computed, or nearly) while the device runs the new one;
the host plans step N+1 without knowing step N's tokens:

- a decoding request's next input is its pending token, which the host writes as
  `future_id` (a negative id naming a row of the step in flight's sampled ids) and
  the device resolves just before the forward (`resolve_future_inputs`);
- lengths stay exact on the host (`Req.num_pending` counts the pending token), so
  slot assignment, positions and length limits need no token values;
- a request that reaches its length limit with its pending token is not decoded again;
  one that stops on a stop token or string was already planned into the next step: that
  step's token for it is dropped when read (nothing is emitted past a stop) and its KV
  goes back with the request's;
- penalties need no token values on the host: their state lives on the device and takes
  each step's sampled ids there (`sampling/penalty_state.py`), pending token included;
- anything that needs the token values before planning (a grammar's mask, retraction,
  jump-forward) makes the step read the pending tokens first (`needs_exact_state` for a
  grammar; retraction drains itself): those batches run without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.request import Req
from radixserve.engine.sched.input_logprobs import InputLogprobPlan
from radixserve.engine.transfer import HostCopy


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device."""

    ready: list[Req]  # the requests that sampled, in the order of next_ids
    takes_token: list[bool]  # per ready row: False for a prefill-only request (n > 1)
    next_ids: torch.Tensor | None  # [len(ready)] int64 on the device; None if none sampled
    host: HostCopy | None  # next ids, chosen logprobs, top-logprob ids and values
    # Prompt logprobs scored in this step: the plan and the host copies of its results.
    scored: tuple[InputLogprobPlan, HostCopy] | None = None


def needs_exact_state(req: Req) -> bool:
    """Whether planning the request's next step needs its previous token on the host:
    a grammar's mask is filled on the host after its matcher accepted that token."""
    return req.grammar is not None


def resolve_future_inputs(input_ids: torch.Tensor, future: torch.Tensor) -> None:
    """In place, on the device: an input id -(r + 1) becomes row r of `future` (the
    sampled ids of the step in flight)."""
    rows = (-input_ids - 1).clamp_(min=0)
    input_ids.copy_(torch.where(input_ids < 0, future[rows], input_ids))
