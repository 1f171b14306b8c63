"""Extend attention: several new query tokens per request over a cached prefix.

One program per (request, KV head, block of new tokens) runs two loops, its BLOCK_M
rows being the block's tokens at each query head that shares the KV head (grouped-query
attention: the group's heads share every K/V block read, rather than each reading it):

1. over the cached prefix, whose K/V sit in the pool at the slots listed in
   kv_indices[kv_indptr[r]:kv_indptr[r + 1]]; every new token sees every prefix key,
   so only the prefix length masks;
2. over the request's new tokens, whose K/V are read straight from the (contiguous)
   k/v inputs of this pass, with the causal mask; keys past the block's last query
   are never visible, so the loop stops there. Over an FP8 pool the caller hands
   them over as the pool stores them (KVPool.as_stored), so every key is read alike.

With a sliding window (WINDOWED) new token i at position p = prefix + i sees only keys
j > p - window: both loops start at the block's first row's window and mask per row.

The requests may be a subset of the batch (a mixed batch's decodes go to the decode
kernel), so each request's rows are given by a start and a length.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.base import FULL_ATTENTION, LayerAttention
from radixserve.engine.attention.triton_ops.common import (
    LOG2E,
    attend_paged_range,
    cap_scores,
    dot_precision,
    kv_fp8,
    online_softmax_step,
)
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale

# Shared memory a block may use (opt-in) from which the larger tiles fit: A100 and H100
# have 163 and 227 KiB; Ada and consumer Ampere ~99 KiB, where they would not compile.
ROOMY_SHARED_MEMORY = 160 * 1024


@functools.cache
def _roomy(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) >= ROOMY_SHARED_MEMORY


def _blocks(dtype: torch.dtype, rows: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a pass whose longest request has
    `rows` query rows per KV head (new tokens x query heads per KV head). float32 tiles
    take twice the shared memory of 16-bit ones, so they are halved to fit. Where shared
    memory allows, 128-row blocks for long passes and three stages for short ones, each
    faster than 64 x 64 tiles in two stages (measured:
    lab/notebook/2026-11-27-triton-extend-kernel-grouped-query-packing.md)."""
    if dtype == torch.float32:
        return 32, 32, 4, 1
    if not _roomy(device):
        return 64, 64, 4, 2
    if rows >= 128:
        return 128, 64, 4, 2
    return 64, 64, 4, 3


# One compiled kernel for every window (it is not specialised on).
@triton.jit(do_not_specialize=["window"])
def _extend_kernel(
    Q,  # [num_tokens, num_heads, head_dim], new tokens of all requests in order
    K_New,  # [num_tokens, num_kv_heads, head_dim]
    V_New,
    Out,  # [num_tokens, num_heads, head_dim]
    K_Buffer,  # [pool slots, num_kv_heads, head_dim]
    V_Buffer,
    q_starts,  # [bs] int64: request r's new tokens are rows q_starts[r] + [0, q_lens[r])
    q_lens,  # [bs] int64
    kv_indptr,  # [bs + 1] int32 over the cached prefixes only
    kv_indices,  # [sum(prefix_lens)] int32 slots
    sm_scale_log2,
    window,  # where WINDOWED: keys a query sees, its own included
    cap_log2,  # where SOFT_CAP: the cap times log2(e)
    k_scale,  # where KV_FP8: the pool's codes times these are K and V
    v_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_M: tl.constexpr,  # rows: TOKENS new tokens x the GROUP_SIZE heads of a KV head
    TOKENS: tl.constexpr,  # BLOCK_M // GROUP_SIZE
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,  # the pool holds e4m3 codes (the new tokens' K/V do not)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    block_m = tl.program_id(2)

    q_start = tl.load(q_starts + req)
    extend_len = tl.load(q_lens + req)
    # The grid is sized for the longest request; shorter ones have no rows here.
    if block_m * TOKENS >= extend_len:
        return
    kv_start = tl.load(kv_indptr + req)
    prefix_len = tl.load(kv_indptr + req + 1) - kv_start

    # Row r is new token block_m * TOKENS + r // GROUP_SIZE of the request, at query head
    # kv_head * GROUP_SIZE + r % GROUP_SIZE: the heads that share a KV head share each
    # K/V block read. Rows past TOKENS * GROUP_SIZE (a group size that is not a power of
    # two) are padding.
    rows = tl.arange(0, BLOCK_M)
    offs_m = block_m * TOKENS + rows // GROUP_SIZE  # query index within the request
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    m_mask = (offs_m < extend_len) & (rows < TOKENS * GROUP_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q_offs = q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_offs, mask=q_mask)

    # Padding query rows (m_mask False) still see key 0, so no row is ever all -inf.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Each row's first visible key (its window's; 0 without one), and the block's least.
    row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    block_lo = 0
    if WINDOWED:
        row_lo = prefix_len + offs_m - window + 1
        block_lo = tl.maximum(prefix_len + block_m * TOKENS - window + 1, 0)

    # 1) the cached prefix, through the slot table.
    m_i, l_i, acc = attend_paged_range(
        q,
        kv_indices + kv_start,
        tl.minimum(block_lo, prefix_len),
        prefix_len,
        K_Buffer,
        V_Buffer,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        kv_head,
        offs_d,
        d_mask,
        sm_scale_log2,
        m_i,
        l_i,
        acc,
        row_lo,
        cap_log2,
        k_scale,
        v_scale,
        BLOCK_N,
        DOT_PRECISION,
        WINDOWED,
        SOFT_CAP,
        KV_FP8,
    )

    # 2) the new tokens, causal: query i sees new keys j <= i (and, windowed, from its
    # row_lo on: new key j is at position prefix_len + j).
    new_hi = tl.minimum(extend_len, (block_m + 1) * TOKENS)
    new_lo = tl.maximum(block_lo - prefix_len, 0)
    for start in range(new_lo, new_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extend_len
        kv_rows = (q_start + offs_n).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K_New + kv_rows[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
        qk = cap_scores(qk, cap_log2, SOFT_CAP)
        visible = (offs_n[None, :] <= offs_m[:, None]) & n_mask[None, :]
        if WINDOWED:
            visible = visible & (prefix_len + offs_n[None, :] >= row_lo[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(
            V_New + kv_rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # Padding rows a window leaves without keys have l_i 0; they are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(Out + o_offs, out.to(Out.dtype.element_ty), mask=q_mask)


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this pass's new K
    v: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_extend_len: int,
    scale: float,
    blocks: tuple[int, int, int, int] | None = None,
    layer: LayerAttention = FULL_ATTENTION,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """`blocks`: (BLOCK_M, BLOCK_N, num_warps, num_stages), for a sweep
    (lab/probes/prefill_kernels.py); by default `_blocks`' choice for the pass.
    `layer`: its window and soft-cap; `kv_scale`: an FP8 pool's scales (k and v are
    then as the pool stores them, KVPool.as_stored)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group_size = num_heads // k.shape[1]
    bs = q_starts.shape[0]
    block_m, block_n, num_warps, num_stages = blocks or _blocks(
        q.dtype, max_extend_len * group_size, q.device
    )
    block_m = max(block_m, triton.next_power_of_2(group_size))  # a token's heads in a block
    tokens = block_m // group_size
    grid = (bs, k.shape[1], triton.cdiv(max_extend_len, tokens))
    _extend_kernel[grid](
        q,
        k,
        v,
        out,
        k_buffer,
        v_buffer,
        q_starts,
        q_lens,
        kv_indptr,
        kv_indices,
        scale * LOG2E,
        layer.window or 0,
        (layer.soft_cap or 1.0) * LOG2E,
        kv_scale.k,
        kv_scale.v,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        TOKENS=tokens,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOWED=layer.window is not None,
        SOFT_CAP=layer.soft_cap is not None,
        KV_FP8=kv_fp8(k_buffer),
        num_warps=num_warps,
        num_stages=num_stages,
    )
