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
before it attends. Over an FP8 pool the kernels widen the codes they read by the
layer's scales (KV_FP8, a constexpr: 16-bit pools compile the kernels as before), and
the extend kernel's new tokens are handed over as the pool stores them, so every key
is the same value whichever kernel reads it.

CUDA graphs (engine/graphs) capture decode passes only. For them the decode tables
live in fixed buffers (kv_indptr for max_bs + 1 requests, kv_indices for max_bs full
contexts) and are rebuilt INSIDE the graph from its static req_pool_indices and
seq_lens (a cumsum and one copy kernel), so a replay needs no host work at all. The
split count is fixed per graph size: enough splits that the programs fill the GPU
whatever the lengths, since a graph cannot choose them from the lengths at replay.

On the CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 set
before triton is imported): slow, but it runs the same kernel code, which is what
the CPU tests check against the torch backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.engine.attention.base import AttentionBackend, check_batch
from radixserve.engine.attention.cascade import CascadeDecode, CascadeGraph, CascadePass
from radixserve.engine.attention.triton_ops.common import INTERPRETED, num_sms
from radixserve.engine.attention.triton_ops.decode import (
    decode_attention,
    graph_num_kv_splits,
    num_kv_splits,
)
from radixserve.engine.attention.triton_ops.extend import extend_attention
from radixserve.engine.attention.triton_ops.indices import build_kv_indices, gather_kv_rows
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale
from radixserve.engine.transfer import upload_int64

if TYPE_CHECKING:
    from radixserve.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DecodePlan:
    q_rows: torch.Tensor  # [bs_d] int64, token row of each decoding request
    kv_indptr: torch.Tensor  # [bs_d + 1] int32 over seq_lens (the new token included)
    kv_indices: torch.Tensor  # int32 slots
    num_splits: int
    in_graph: bool = False  # split-KV scratch from the fixed graph buffer


@dataclass
class _GraphState:
    """The fixed buffers every captured decode graph reads its tables from."""

    max_bs: int
    kv_indptr: torch.Tensor  # [max_bs + 1] int32; entry 0 stays 0
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int32
    q_rows: torch.Tensor  # [max_bs] int64: arange (one token per request)
    num_sms: int
    max_context_len: int
    cascade: CascadeGraph | None = None  # the cascade graphs' tables, at their first capture
    # Split-KV scratch for every graph size (allocated at the first graph pass, when the
    # head shape is known; never reallocated, since captured graphs hold its address).
    mid_out: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None


@dataclass(frozen=True)
class _ExtendPlan:
    q_starts: torch.Tensor  # [bs_e] int64, token row of each request's first new token
    q_lens: torch.Tensor  # [bs_e] int64, its number of new tokens
    kv_indptr: torch.Tensor  # [bs_e + 1] int32 over the cached prefix lengths
    kv_indices: torch.Tensor  # int32 slots of the cached prefixes
    max_extend_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    supports_shared_prefix = True
    supports_layer_attention = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                f"the triton attention backend needs CUDA; on {device.type} it runs only "
                "under the Triton interpreter (set TRITON_INTERPRET=1 before start-up)"
            )
        if device.type == "cuda" and INTERPRETED:
            log.warning("TRITON_INTERPRET is set: triton attention runs on the host, slowly")
        self.device = device
        self._decode: _DecodePlan | None = None
        self._extend: _ExtendPlan | None = None
        self._cascade: CascadePass | None = None
        # Split-KV partial results, reused by every layer and pass (grown on demand):
        # stage 1 writes every entry stage 2 reads, so stale contents are harmless.
        self._scratch: dict[str, torch.Tensor] = {}
        self._graph: _GraphState | None = None
        self._num_sms = num_sms(device)

    # -- per batch ------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        check_batch(batch)
        self._cascade = None
        extend_lens = batch.extend_seq_lens_cpu
        if batch.shared_prefixes:
            # The leading one-token rows run cascade; the rest (a mixed batch's prefills)
            # run the extend kernel.
            self._cascade = CascadeDecode(batch)
            rest = list(range(self._cascade.rows, batch.batch_size))
            self._decode = None
            self._extend = None if not rest else _extend_plan(batch, rest)
            return
        decode = [i for i, n in enumerate(extend_lens) if n == 1]
        extend = [i for i, n in enumerate(extend_lens) if n > 1]
        # None: the group is the whole batch, and its tensors are used as they are.
        self._decode = None if not decode else _decode_plan(batch, None if not extend else decode)
        self._extend = None if not extend else _extend_plan(batch, None if not decode else extend)

    # -- CUDA graphs ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        device = self.device
        self._graph = _GraphState(
            max_bs=max_bs,
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=device),
            q_rows=torch.arange(max_bs, dtype=torch.int64, device=device),
            num_sms=self._num_sms,
            max_context_len=max_context_len,
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch, cascade: bool = False) -> None:
        graph = self._graph
        if graph is None:
            raise RuntimeError("init_cuda_graph_state must run before a graph is captured")
        bs = batch.batch_size
        if batch.mode != ForwardMode.DECODE or bs > graph.max_bs:
            raise ValueError(f"graphs capture decode batches of up to {graph.max_bs} requests")
        if cascade:
            self._decode = self._extend = None
            self._cascade = self._cascade_graph(graph).capture(batch)
            return
        kv_indptr = graph.kv_indptr[: bs + 1]
        # Queued on the device (recorded in the graph): the tables follow whatever
        # req_pool_indices and seq_lens hold when the graph is replayed.
        gather_kv_rows(
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, kv_indptr, graph.kv_indices
        )
        self._cascade = None
        self._decode = _DecodePlan(
            q_rows=graph.q_rows[:bs],
            kv_indptr=kv_indptr,
            kv_indices=graph.kv_indices,
            num_splits=graph_num_kv_splits(bs, batch.kv_pool.k_buffers[0].shape[1], graph.num_sms),
            in_graph=True,
        )
        self._extend = None

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        if batch.shared_prefixes:
            assert self._graph is not None
            self._cascade_graph(self._graph).write(batch, num_real)

    def _cascade_graph(self, graph: _GraphState) -> CascadeGraph:
        if graph.cascade is None:
            graph.cascade = CascadeGraph(
                graph.max_bs, graph.max_context_len, graph.kv_indices, self.device
            )
        return graph.cascade

    # -- per layer ------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if self._decode is None and self._extend is None and self._cascade is None:
            raise RuntimeError("init_forward_metadata must run before the first layer")
        num_tokens, num_heads, head_dim = q.shape
        if INTERPRETED and q.dtype == torch.bfloat16:
            # Its tl.dot multiplies bfloat16 operands as their raw 16-bit patterns.
            raise ValueError(
                "the Triton interpreter cannot multiply bfloat16; use float32 or float16"
            )
        if num_heads % k.shape[1]:
            raise ValueError(f"{num_heads} query heads do not split over {k.shape[1]} KV heads")
        if not kv_stored:
            batch.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        pool = batch.kv_pool
        k_buffer = pool.k_buffers[layer_id]
        v_buffer = pool.v_buffers[layer_id]
        kv_scale = pool.scales[layer_id]
        # The kernels take token and head strides but assume a dense head_dim.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if self._cascade is not None and self._extend is None:
            return self._cascade.forward(q, k_buffer, v_buffer, scale, kv_scale=kv_scale)
        layer = self.layer(layer_id)
        # Each group writes its own token rows; together they cover every row.
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if isinstance(self._cascade, CascadeDecode):
            rows = self._cascade.rows
            self._cascade.forward(
                q[:rows], k_buffer, v_buffer, scale, out=out[:rows], kv_scale=kv_scale
            )
        if self._decode is not None:
            plan = self._decode
            shape = (plan.q_rows.shape[0], num_heads, plan.num_splits)
            if plan.in_graph:
                mid_out, mid_lse = self._graph_scratch(shape, head_dim, k.shape[1])
            else:
                mid_out = self._buffer("mid_out", (*shape, head_dim), q.device)
                mid_lse = self._buffer("mid_lse", shape, q.device)
            decode_attention(
                q,
                k_buffer,
                v_buffer,
                out,
                plan.q_rows,
                plan.kv_indptr,
                plan.kv_indices,
                mid_out,
                mid_lse,
                scale,
                layer=layer,
                kv_scale=kv_scale,
            )
        if self._extend is not None:
            k_new, v_new = pool.as_stored(layer_id, k, v)
            extend_attention(
                q,
                k_new,
                v_new,
                out,
                k_buffer,
                v_buffer,
                self._extend.q_starts,
                self._extend.q_lens,
                self._extend.kv_indptr,
                self._extend.kv_indices,
                self._extend.max_extend_len,
                scale,
                layer=layer,
                kv_scale=kv_scale,
            )
        return out

    def _graph_scratch(
        self, shape: tuple[int, int, int], head_dim: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the fixed split-KV scratch, sized at the first graph pass for the
        largest (batch size x splits) any graph size takes."""
        graph = self._graph
        assert graph is not None
        num_heads = shape[1]
        if graph.mid_lse is None:
            rows = max(
                bs * graph_num_kv_splits(bs, num_kv_heads, graph.num_sms)
                for bs in range(1, graph.max_bs + 1)
            )
            graph.mid_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=self.device)
            graph.mid_out = torch.empty(
                rows * num_heads * head_dim, dtype=torch.float32, device=self.device
            )
        assert graph.mid_out is not None
        numel = shape[0] * shape[1] * shape[2]
        if numel > graph.mid_lse.numel() or numel * head_dim > graph.mid_out.numel():
            raise RuntimeError("graph scratch was sized for another head shape")
        mid_out = graph.mid_out[: numel * head_dim].view(*shape, head_dim)
        return mid_out, graph.mid_lse[:numel].view(shape)

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


class DecodeRows:
    """Triton's split-KV decode over a pass's leading one-token rows, for another backend
    that runs the rest of the batch (FlashInfer's SM90 prefill, which is slow on them)."""

    def __init__(self, batch: ForwardBatch, rows: int) -> None:
        self.rows = rows
        self._plan = _decode_plan(batch, list(range(rows)))
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # at the first layer

    def forward(
        self,
        q: torch.Tensor,  # the pass's tokens; the decoding rows are its first `rows`
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out: torch.Tensor,  # rows [:rows] are written
        scale: float,
        kv_scale: KVScale = UNIT_SCALE,
    ) -> None:
        plan = self._plan
        if self._scratch is None:
            shape = (self.rows, q.shape[1], plan.num_splits)
            self._scratch = (
                torch.empty((*shape, q.shape[2]), dtype=torch.float32, device=q.device),
                torch.empty(shape, dtype=torch.float32, device=q.device),
            )
        decode_attention(
            q, k_buffer, v_buffer, out, plan.q_rows, plan.kv_indptr, plan.kv_indices,
            *self._scratch, scale, kv_scale=kv_scale,
        )  # fmt: skip


def _decode_plan(batch: ForwardBatch, members: list[int] | None) -> _DecodePlan:
    rows, q_rows = batch.req_pool_indices, batch.extend_start_loc
    seq_lens, seq_lens_cpu = batch.seq_lens, batch.seq_lens_cpu
    if members is not None:
        picked = upload_int64(members, rows.device)
        rows, q_rows, seq_lens = rows[picked], q_rows[picked], seq_lens[picked]
        seq_lens_cpu = [seq_lens_cpu[i] for i in members]
    kv_indptr, kv_indices = build_kv_indices(batch.req_to_token, rows, seq_lens, sum(seq_lens_cpu))
    return _DecodePlan(q_rows, kv_indptr, kv_indices, num_kv_splits(max(seq_lens_cpu)))


def _extend_plan(batch: ForwardBatch, members: list[int] | None) -> _ExtendPlan:
    rows, q_starts, q_lens = batch.req_pool_indices, batch.extend_start_loc, batch.extend_seq_lens
    prefix_lens, prefix_lens_cpu = batch.extend_prefix_lens, batch.extend_prefix_lens_cpu
    extend_lens_cpu = batch.extend_seq_lens_cpu
    if members is not None:
        picked = upload_int64(members, rows.device)
        rows, q_starts, q_lens = rows[picked], q_starts[picked], q_lens[picked]
        prefix_lens = prefix_lens[picked]
        prefix_lens_cpu = [prefix_lens_cpu[i] for i in members]
        extend_lens_cpu = [extend_lens_cpu[i] for i in members]
    kv_indptr, kv_indices = build_kv_indices(
        batch.req_to_token, rows, prefix_lens, sum(prefix_lens_cpu)
    )
    return _ExtendPlan(q_starts, q_lens, kv_indptr, kv_indices, max(extend_lens_cpu))
