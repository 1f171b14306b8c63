"""Attention through Triton kernels over the paged KV pool: the GPU backend.

`init_forward_metadata` splits each batch, as the torch backend does, into the
requests that add one token (decode) and those that add several (extend), and builds
each group's index tables on the device once, shared by every layer:

- decode: flat slot tables over the whole sequences and a split count for the
  split-KV kernel (triton_ops/decode.py);
- extend: flat slot tables over the cached prefixes only, and where each request's
  new tokens sit in this pass's q/k/v (triton_ops/extend.py reads the new tokens'
  K/V from there).

A mixed batch runs both kernels on its two groups: a decode request inside the
extend kernel would fill one row of a 64-row query tile and read its KV once per
query head instead of once per KV head.

Each layer writes its new K/V into the pool, exactly as the torch backend does,
before it attends.

On the CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 set
before triton is imported): slow, but it runs the same kernel code, which is what
the CPU tests check against the torch backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.engine.attention.base import AttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.attention.triton_ops.decode import decode_attention, num_kv_splits
from radixserve.engine.attention.triton_ops.extend import extend_attention
from radixserve.engine.attention.triton_ops.indices import build_kv_indices
from radixserve.engine.forward_batch import ForwardMode

if TYPE_CHECKING:
    from radixserve.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DecodePlan:
    q_rows: torch.Tensor  # [bs_d] int64, token row of each decoding request
    kv_indptr: torch.Tensor  # [bs_d + 1] int32 over seq_lens (the new token included)
    kv_indices: torch.Tensor  # int32 slots
    num_splits: int


@dataclass(frozen=True)
class _ExtendPlan:
    q_starts: torch.Tensor  # [bs_e] int64, token row of each request's first new token
    q_lens: torch.Tensor  # [bs_e] int64, its number of new tokens
    kv_indptr: torch.Tensor  # [bs_e + 1] int32 over the cached prefix lengths
    kv_indices: torch.Tensor  # int32 slots of the cached prefixes
    max_extend_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                f"the triton attention backend needs CUDA; on {device.type} it runs only "
                "under the Triton interpreter (set TRITON_INTERPRET=1 before start-up)"
            )
        if device.type == "cuda" and INTERPRETED:
            log.warning("TRITON_INTERPRET is set: triton attention runs on the host, slowly")
        self._decode: _DecodePlan | None = None
        self._extend: _ExtendPlan | None = None
        # Split-KV partial results, reused by every layer and pass (grown on demand):
        # stage 1 writes every entry stage 2 reads, so stale contents are harmless.
        self._scratch: dict[str, torch.Tensor] = {}

    # -- per batch ------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        _check_batch(batch)
        extend_lens = batch.extend_seq_lens_cpu
        decode = [i for i, n in enumerate(extend_lens) if n == 1]
        extend = [i for i, n in enumerate(extend_lens) if n > 1]
        # None: the group is the whole batch, and its tensors are used as they are.
        self._decode = None if not decode else _decode_plan(batch, None if not extend else decode)
        self._extend = None if not extend else _extend_plan(batch, None if not decode else extend)

    # -- per layer ------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        if self._decode is None and self._extend is None:
            raise RuntimeError("init_forward_metadata must run before the first layer")
        num_tokens, num_heads, head_dim = q.shape
        if INTERPRETED and q.dtype == torch.bfloat16:
            # Its tl.dot multiplies bfloat16 operands as their raw 16-bit patterns.
            raise ValueError(
                "the Triton interpreter cannot multiply bfloat16; use float32 or float16"
            )
        if num_heads % k.shape[1]:
            raise ValueError(f"{num_heads} query heads do not split over {k.shape[1]} KV heads")
        batch.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buffer = batch.kv_pool.k_buffers[layer_id]
        v_buffer = batch.kv_pool.v_buffers[layer_id]
        # The kernels take token and head strides but assume a dense head_dim.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        # Each group writes its own token rows; together they cover every row.
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if self._decode is not None:
            plan = self._decode
            shape = (plan.q_rows.shape[0], num_heads, plan.num_splits)
            decode_attention(
                q,
                k_buffer,
                v_buffer,
                out,
                plan.q_rows,
                plan.kv_indptr,
                plan.kv_indices,
                self._buffer("mid_out", (*shape, head_dim), q.device),
                self._buffer("mid_lse", shape, q.device),
                scale,
            )
        if self._extend is not None:
            extend_attention(
                q,
                k,
                v,
                out,
                k_buffer,
                v_buffer,
                self._extend.q_starts,
                self._extend.q_lens,
                self._extend.kv_indptr,
                self._extend.kv_indices,
                self._extend.max_extend_len,
                scale,
            )
        return out

    def _buffer(self, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 scratch view of `shape`, carved from a buffer kept across passes."""
        numel = 1
        for size in shape:
            numel *= size
        flat = self._scratch.get(key)
        if flat is None or flat.numel() < numel or flat.device != device:
            flat = torch.empty(numel, dtype=torch.float32, device=device)
            self._scratch[key] = flat
        return flat[:numel].view(shape)


def _decode_plan(batch: ForwardBatch, members: list[int] | None) -> _DecodePlan:
    rows, q_rows = batch.req_pool_indices, batch.extend_start_loc
    seq_lens, seq_lens_cpu = batch.seq_lens, batch.seq_lens_cpu
    if members is not None:
        picked = torch.tensor(members, dtype=torch.int64, device=rows.device)
        rows, q_rows, seq_lens = rows[picked], q_rows[picked], seq_lens[picked]
        seq_lens_cpu = [seq_lens_cpu[i] for i in members]
    kv_indptr, kv_indices = build_kv_indices(batch.req_to_token, rows, seq_lens, sum(seq_lens_cpu))
    return _DecodePlan(q_rows, kv_indptr, kv_indices, num_kv_splits(max(seq_lens_cpu)))


def _extend_plan(batch: ForwardBatch, members: list[int] | None) -> _ExtendPlan:
    rows, q_starts, q_lens = batch.req_pool_indices, batch.extend_start_loc, batch.extend_seq_lens
    prefix_lens, prefix_lens_cpu = batch.extend_prefix_lens, batch.extend_prefix_lens_cpu
    extend_lens_cpu = batch.extend_seq_lens_cpu
    if members is not None:
        picked = torch.tensor(members, dtype=torch.int64, device=rows.device)
        rows, q_starts, q_lens = rows[picked], q_starts[picked], q_lens[picked]
        prefix_lens = prefix_lens[picked]
        prefix_lens_cpu = [prefix_lens_cpu[i] for i in members]
        extend_lens_cpu = [extend_lens_cpu[i] for i in members]
    kv_indptr, kv_indices = build_kv_indices(
        batch.req_to_token, rows, prefix_lens, sum(prefix_lens_cpu)
    )
    return _ExtendPlan(q_starts, q_lens, kv_indptr, kv_indices, max(extend_lens_cpu))


def _check_batch(batch: ForwardBatch) -> None:
    """The lengths the kernels index by must agree; a mismatch would read wrong slots."""
    if batch.batch_size == 0:
        raise ValueError("an attention batch needs at least one request")
    lens = zip(
        batch.seq_lens_cpu, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
    )
    for i, (seq, pre, ext) in enumerate(lens):
        if ext < 1 or seq != pre + ext:
            raise ValueError(
                f"request {i}: seq_len {seq} must equal prefix {pre} + new tokens {ext} (>= 1)"
            )
    if batch.mode == ForwardMode.DECODE and max(batch.extend_seq_lens_cpu) != 1:
        raise ValueError("a DECODE batch must add exactly one token per request")
