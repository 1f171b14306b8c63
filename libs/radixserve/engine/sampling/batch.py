"""The per-step sampling tensors of a batch, built once from its requests.

The builder walks the requests in Python to collect scalars and token lists (cheap); it
then uploads them in a few tensors. Penalties come from the engine's `PenaltyState` when
one is given (rows kept on the device across steps), else from the token lists.
Everything else that touches the vocabulary happens later, in `sampler.sample`, as
batched tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field

import torch

from radixserve.engine.sampling.inputs import SamplingInput
from radixserve.engine.sampling.noise import row_uniforms
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sampling.penalties import LogitBias, Penalties, StopTokenMask
from radixserve.engine.sampling.penalty_state import PenaltyState
from radixserve.engine.transfer import upload

# Above this top-k a full sort beats torch.topk.
MAX_TOPK_WITHOUT_SORT = 1024


@dataclass(frozen=True, eq=False)
class SamplingRequest:
    """A plain `SamplingInput`, for callers without an engine `Req` (and for tests). Equal
    only to itself, as a `Req`: a `PenaltyState` keys its rows by request."""

    params: SamplingParams
    seed: int
    origin_input_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_token_ids: Set[int] = field(default_factory=frozenset)
    num_pending: int = 0


@dataclass(frozen=True)
class SampledRows:
    """The rows drawn at random, with their parameters as [m, 1] columns on the device."""

    rows: torch.Tensor  # [m] int64: indices into the batch
    is_whole_batch: bool  # rows == arange(bs): skip the gather and the scatter
    temperatures: torch.Tensor  # [m, 1] float32
    top_ks: torch.Tensor  # [m, 1] int64; vocab_size where top-k is off
    top_ps: torch.Tensor  # [m, 1] float32; +inf where top-p is off
    min_ps: torch.Tensor  # [m, 1] float32; 0 where min-p is off
    uniforms: torch.Tensor  # [m, 1] float32 in (0, 1): this step's draw per row
    max_top_k: int  # largest enabled top-k; 0 when no row uses top-k
    use_top_p: bool
    use_min_p: bool

    @property
    def needs_sort(self) -> bool:
        return self.use_top_p or self.max_top_k > MAX_TOPK_WITHOUT_SORT


@dataclass(frozen=True)
class SamplingBatch:
    batch_size: int
    vocab_size: int
    device: torch.device
    penalties: Penalties | None  # None: no row has a penalty
    stop_mask: StopTokenMask | None  # None: no row is short of min_new_tokens
    sampled: SampledRows | None  # None: every row is greedy
    return_logprob: bool  # some row wants logprobs
    top_logprobs_num: int  # the largest top_logprobs_num of a row that wants logprobs
    bias: LogitBias | None = None  # None: no row has a logit_bias

    @classmethod
    def build(
        cls,
        reqs: Sequence[SamplingInput],
        vocab_size: int,
        device: torch.device | str,
        penalty_state: PenaltyState | None = None,
    ) -> SamplingBatch:
        """`penalty_state`: gather the penalties from it (giving new penalized requests a
        row); without it they are rebuilt from the requests' token lists."""
        if not reqs:
            raise ValueError("cannot build a sampling batch with no requests")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive (got {vocab_size})")
        device = torch.device(device)
        params = [req.params for req in reqs]
        if penalty_state is not None:
            penalties = penalty_state.gather(reqs)
        else:
            penalties = Penalties.build(
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
                [req.origin_input_ids for req in reqs],
                [req.output_ids for req in reqs],
                vocab_size,
                device,
            )
        stop_mask = StopTokenMask.build(
            [sorted(req.stop_token_ids) for req in reqs],
            [len(req.output_ids) + req.num_pending for req in reqs],
            [p.min_new_tokens for p in params],
            vocab_size,
            device,
        )
        wants_logprob = [p for p in params if p.return_logprob]
        return cls(
            batch_size=len(reqs),
            vocab_size=vocab_size,
            device=device,
            penalties=penalties,
            stop_mask=stop_mask,
            sampled=_build_sampled_rows(reqs, vocab_size, device),
            return_logprob=bool(wants_logprob),
            top_logprobs_num=max((p.top_logprobs_num for p in wants_logprob), default=0),
            bias=LogitBias.build([p.logit_bias for p in params], vocab_size, device),
        )


def _build_sampled_rows(
    reqs: Sequence[SamplingInput], vocab_size: int, device: torch.device
) -> SampledRows | None:
    rows = [r for r, req in enumerate(reqs) if not req.params.is_greedy]
    if not rows:
        return None
    params = [reqs[r].params for r in rows]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    # The draw depends on (seed, output position) only: see noise.py.
    uniforms = row_uniforms(
        [reqs[r].seed for r in rows],
        [len(reqs[r].output_ids) + reqs[r].num_pending for r in rows],
    )
    # One upload for the floats and one for the ints; neither waits for the device.
    floats = upload(
        torch.stack(
            [
                torch.tensor([p.temperature for p in params], dtype=torch.float32),
                torch.tensor(top_ps, dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32),
                torch.from_numpy(uniforms),
            ]
        ),
        device,
    )
    ints = upload(torch.tensor([rows, top_ks], dtype=torch.int64), device)
    enabled_ks = [k for k in top_ks if k < vocab_size]
    return SampledRows(
        rows=ints[0],
        is_whole_batch=len(rows) == len(reqs),
        temperatures=floats[0].unsqueeze(1),
        top_ks=ints[1].unsqueeze(1),
        top_ps=floats[1].unsqueeze(1),
        min_ps=floats[2].unsqueeze(1),
        uniforms=floats[3].unsqueeze(1),
        max_top_k=max(enabled_ks, default=0),
        use_top_p=any(p < 1.0 for p in top_ps),
        use_min_p=any(p.min_p > 0.0 for p in params),
    )
