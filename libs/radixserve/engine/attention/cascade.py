"""Cascade decode: requests that share a cached prefix read it from HBM once per step.

A decode batch's `shared_prefixes` (found by the scheduler on the radix tree) name
groups of requests whose first `length` KV slots are the same. Without cascade every
member reads that prefix on its own at every step: 16 requests over a 2048-token
system prompt read it 16 times. Here the group's members attend over the prefix
together (triton_ops/shared_prefix.py: their query heads stacked in one tile), each
request attends over the rest of its own KV with the split-KV decode kernel, and the
partial results are merged by their log-sum-exps: the same softmax, fewer bytes.

The tables are built on the device once per pass (the first layer also sizes the
scratch and picks the split counts, which depend on the head shape); each layer
then runs three kernels. Cascade passes are not captured in CUDA graphs (the group
layout changes from step to step), so the scheduler asks for them only where the
bytes saved outweigh eager launches (sched/shared_prefix.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from radixserve.engine.attention.triton_ops.common import num_sms
from radixserve.engine.attention.triton_ops.decode import MAX_SPLITS, decode_partials, num_kv_splits
from radixserve.engine.attention.triton_ops.indices import build_kv_indices
from radixserve.engine.attention.triton_ops.shared_prefix import (
    members_per_tile,
    merge_splits,
    shared_prefix_attention,
)
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.transfer import upload_int64

# A split of the prefix shorter than this costs more to merge than it adds in parallelism.
_MIN_PREFIX_TOKENS_PER_SPLIT = 256


@dataclass
class _Scratch:
    mid_out: torch.Tensor  # [bs, num_heads, prefix_splits + suffix_splits, head_dim] fp32
    mid_lse: torch.Tensor  # [bs, num_heads, prefix_splits + suffix_splits] fp32
    prefix_splits: int


class CascadeDecode:
    """One decode pass with shared prefixes: planned at construction, run per layer."""

    def __init__(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.DECODE or not batch.shared_prefixes:
            raise ValueError("cascade decode runs DECODE batches with shared prefixes")
        bs = batch.batch_size
        prefix_of = [0] * bs
        members: list[int] = []
        member_indptr = [0]
        leaders: list[int] = []
        lengths: list[int] = []
        for group in batch.shared_prefixes:
            for i in group.members:
                if prefix_of[i] or group.length >= batch.seq_lens_cpu[i]:
                    raise ValueError(f"request {i}: in two groups, or no KV past its prefix")
                prefix_of[i] = group.length
            members.extend(group.members)
            member_indptr.append(len(members))
            leaders.append(group.members[0])
            lengths.append(group.length)
        suffix_lens = [n - p for n, p in zip(batch.seq_lens_cpu, prefix_of, strict=True)]
        num_groups = len(lengths)
        packed = upload_int64(
            members + member_indptr + leaders + lengths + prefix_of + suffix_lens,
            batch.req_to_token.device,
        )
        cut = [len(members), num_groups + 1, num_groups, num_groups, bs, bs]
        members_t, indptr_t, leaders_t, lengths_t, prefix_t, suffix_t = packed.split(cut)
        self.members = members_t
        self.member_indptr = indptr_t
        self.max_members = max(len(g.members) for g in batch.shared_prefixes)
        self.max_prefix = max(lengths)
        self.num_groups = num_groups
        # Any member's row holds the group's prefix slots.
        self.prefix_indptr, self.prefix_indices = build_kv_indices(
            batch.req_to_token, batch.req_pool_indices[leaders_t], lengths_t, sum(lengths)
        )
        self.suffix_indptr, self.suffix_indices = build_kv_indices(
            batch.req_to_token, batch.req_pool_indices, suffix_t, sum(suffix_lens), prefix_t
        )
        self.suffix_splits = num_kv_splits(max(suffix_lens))
        self.q_rows = batch.extend_start_loc  # a decode batch's token r is request r's
        self._scratch: _Scratch | None = None

    def forward(
        self,
        q: torch.Tensor,  # [bs, num_heads, head_dim]
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels assume dense head_dim
        scratch = self._scratch or self._new_scratch(q, k_buffer.shape[1])
        split = scratch.prefix_splits
        shared_prefix_attention(
            q,
            k_buffer,
            v_buffer,
            self.members,
            self.member_indptr,
            self.max_members,
            self.prefix_indptr,
            self.prefix_indices,
            scratch.mid_out[:, :, :split],
            scratch.mid_lse[:, :, :split],
            scale,
        )
        decode_partials(
            q,
            k_buffer,
            v_buffer,
            self.q_rows,
            self.suffix_indptr,
            self.suffix_indices,
            scratch.mid_out[:, :, split:],
            scratch.mid_lse[:, :, split:],
            scale,
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        merge_splits(scratch.mid_out, scratch.mid_lse, out)
        return out

    def _new_scratch(self, q: torch.Tensor, num_kv_heads: int) -> _Scratch:
        """Sized at the first layer, when the head shape is known. Unwritten splits read
        as -inf: every layer writes the same ones, so one fill serves the pass."""
        bs, num_heads, head_dim = q.shape
        tiles = triton.cdiv(self.max_members, members_per_tile(num_heads // num_kv_heads))
        programs = self.num_groups * num_kv_heads * tiles
        wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms(q.device), programs))
        cap = triton.next_power_of_2(triton.cdiv(self.max_prefix, _MIN_PREFIX_TOKENS_PER_SPLIT))
        prefix_splits = max(1, min(wanted, cap, MAX_SPLITS))
        splits = prefix_splits + self.suffix_splits
        self._scratch = _Scratch(
            mid_out=torch.empty(
                (bs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
            ),
            mid_lse=torch.full(
                (bs, num_heads, splits), float("-inf"), dtype=torch.float32, device=q.device
            ),
            prefix_splits=prefix_splits,
        )
        return self._scratch
