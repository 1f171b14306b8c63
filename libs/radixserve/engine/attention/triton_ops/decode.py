"""Decode attention with split-KV (flash-decoding): one new query token per request.

One query row per request is too little work for a GPU when the batch is small, so
each request's KV is cut into `num_splits` ranges attended in parallel:

- stage 1, one program per (request, KV head, split): the query heads that share the
  KV head are stacked as the rows of one tile, so each K/V block is loaded once for
  the whole group (GQA) and the scores are a tensor-core dot; it writes the split's
  normalised partial output and its log-sum-exp.
- stage 2, one program per (request, query head): merges the splits' partial outputs,
  weighting each by exp(lse_split - lse_total).

With one split (what CUDA graphs of many requests run) stage 2 would only copy, so
stage 1 writes the normalised output straight into `out` instead (DIRECT). A
one-split pass can also fold in partials other kernels wrote before it (the cascade's
shared-prefix splits, `decode_merged`): it merges them by their log-sum-exps before
writing, so no merge kernel runs.

KV slots come from the flat `kv_indices` table (request r's slots are
kv_indices[kv_indptr[r]:kv_indptr[r + 1]]), so paging is invisible here. The requests
may be the decoding subset of a mixed batch, so each one's token row is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.base import FULL_ATTENTION, LayerAttention
from radixserve.engine.attention.triton_ops.common import (
    LOG2E,
    attend_paged_range,
    dot_precision,
    fold_partial,
    kv_fp8,
    num_sms,
    programmatic_launch,
)
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale

# tl.dot needs at least 16 rows; a GQA group smaller than this leaves rows masked.
_BLOCK_H = 16
# A split shorter than this costs more in its reduction than it saves in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


def num_kv_splits(max_seq_len: int) -> int:
    """Splits for a decode batch: enough that long sequences fill the GPU, and a power
    of two so the few possible values each compile (and cache) once."""
    wanted = triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    return min(MAX_SPLITS, triton.next_power_of_2(wanted))


def graph_num_kv_splits(bs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits for a captured decode graph of `bs` requests: a power of two (at most
    MAX_SPLITS) giving at least two programs per SM, whatever the lengths at replay.
    Trailing splits of a short sequence are empty and cost a program launch each.
    From 33 requests of 8 KV heads on an H100 (132 SMs) it is one split, which writes
    the output in one pass (no stage 2).
    (4 or 8 programs per SM made decode steps slower than 2; measured: lab/notebook/2026-12-01-figures-from-code-comments.md.)"""
    wanted = triton.cdiv(2 * num_sms, bs * num_kv_heads)
    return min(MAX_SPLITS, triton.next_power_of_2(wanted))


@dataclass(frozen=True)
class LaunchOptions:
    """Stage 1's keys per loop step and Triton launch options."""

    block_n: int
    num_warps: int
    num_stages: int


def launch_options(num_splits: int, programs: int, sms: int) -> LaunchOptions:
    """Stage 1's options for `num_splits` splits over `programs` programs (requests x KV
    heads x splits) on `sms` SMs, from lab/probes/decode_attention.py on an
    H100 (bf16, 32 query / 8 KV heads, head dim 128, context 528, one layer in a CUDA
    graph, both stages timed; (block_n, warps, stages): ms):

    - 1 split (bs 64): (64, 2, 2) 0.0553 against 0.0600 for (64, 4, 2); the sweep's
      best, (32, 4, 3), 0.0552. Each program walks a whole sequence, and there are
      requests x KV heads of them: at two warps each, more of them stay resident.
    - 2-16 splits (bs 1-32): (64, 2, 3) against (64, 4, 2), contexts 544 and 4096:
      bs 2 0.0130 against 0.0174 at 4096; bs 8 0.0522 against 0.0566 at 4096; bs 16
      0.0135 against 0.0156 at 544 and 0.0967 against 0.1043 at 4096; within ~10% of
      the sweep's best everywhere (bs 1 at 544: 0.0066 against 0.0060). In the engine
      (one_batch.py, 2048-token prompts) decode steps of 1-32 requests took 0.05-0.24
      ms less. At 32768 tokens: bs 1 0.073 against 0.138, bs 2 0.099 against 0.147.
    - No more programs than SMs (bs 1: 8 KV heads x 16 splits): each program carries
      more in flight, (128, 4, 3): bs 1 0.057 against 0.073 at 32768, 0.0097-0.0100
      against 0.0110 at 4096, 0.0069-0.0071 against 0.0067 at 544."""
    if num_splits == 1:
        return LaunchOptions(block_n=64, num_warps=2, num_stages=2)
    if programs <= sms:
        return LaunchOptions(block_n=128, num_warps=4, num_stages=3)
    return LaunchOptions(block_n=64, num_warps=2, num_stages=3)


# num_splits changes from batch to batch: one compiled kernel for every value (and for
# every window: 0 is none).
@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    Q,  # [num_tokens, num_heads, head_dim]
    q_rows,  # [bs] int64: the row of Q holding request r's one new token
    K_Buffer,  # [pool slots, num_kv_heads, head_dim]
    V_Buffer,
    kv_indptr,  # [bs + 1] int32
    kv_indices,  # [sum(seq_lens)] int32 slots
    Mid_O,  # [bs, num_heads, num_splits, head_dim] fp32, normalised per split
    Mid_Lse,  # [bs, num_heads, num_splits] fp32, log2-sum-exp2 per split
    Out,  # [num_tokens, num_heads, head_dim]: written instead of Mid_O/Mid_Lse if DIRECT
    sm_scale_log2,
    num_splits,
    window,  # > 0: only the last `window` keys of each request (its sliding window)
    cap_log2,  # the soft-cap times log2(e), where SOFT_CAP
    k_scale,  # where KV_FP8: stored codes times these are K and V
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    stride_lse_t,
    stride_lse_h,
    stride_ot,
    stride_oh,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output, in Out's dtype
    MERGE_SPLITS: tl.constexpr,  # with DIRECT: fold Mid_O/Mid_Lse splits [0, MERGE_SPLITS) in
    WAIT_TO_MERGE: tl.constexpr,  # launched as a programmatic dependent of their writer
    SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,  # the buffers hold e4m3 codes
):
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    # A group larger than BLOCK_H is covered by several programs per KV head.
    BLOCKS_PER_GROUP: tl.constexpr = (GROUP_SIZE + BLOCK_H - 1) // BLOCK_H
    kv_head = head_block // BLOCKS_PER_GROUP
    in_group = (head_block % BLOCKS_PER_GROUP) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = in_group < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + in_group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    kv_start = tl.load(kv_indptr + req)
    seq_len = tl.load(kv_indptr + req + 1) - kv_start
    # The keys the new token sees: [first, seq_len) (a window's last keys, else all).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Every split but the last covers split_len keys; trailing splits may be empty
    # when the keys are fewer than num_splits, and stage 2 skips them by the same
    # arithmetic.
    split_len = tl.cdiv(seq_len - first, num_splits)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    q_row = tl.load(q_rows + req)
    q_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = attend_paged_range(
        q,
        kv_indices + kv_start,
        lo,
        hi,
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
        0,
        cap_log2,
        k_scale,
        v_scale,
        BLOCK_N,
        DOT_PRECISION,
        False,  # one query position per request: the range is its window
        SOFT_CAP,
        KV_FP8,
    )

    if DIRECT:
        if WAIT_TO_MERGE:
            # Everything above read what kernels before the partials' writer wrote; the
            # partials themselves, and `Out`, only after that kernel is done.
            tl.extra.cuda.gdc_wait()
        # Fold in the partials written before this kernel (-inf where none was).
        for s in tl.static_range(MERGE_SPLITS):
            lse = tl.load(
                Mid_Lse + req * stride_lse_t + heads * stride_lse_h + s,
                mask=head_mask,
                other=float("-inf"),
            )
            written = lse > float("-inf")
            mid = req * stride_mid_t + heads * stride_mid_h + s * stride_mid_s
            # Masked, not weighted: an unwritten partial is stale scratch (maybe NaN).
            part = tl.load(
                Mid_O + mid[:, None] + offs_d[None, :],
                mask=q_mask & written[:, None],
                other=0.0,
            )
            m_i, l_i, acc = fold_partial(m_i, l_i, acc, lse, part)
        o = q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(Out + o, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=q_mask)
    elif hi > lo:
        mid = req * stride_mid_t + heads * stride_mid_h + split * stride_mid_s
        tl.store(Mid_O + mid[:, None] + offs_d[None, :], acc / l_i[:, None], mask=q_mask)
        lse = req * stride_lse_t + heads * stride_lse_h + split
        tl.store(Mid_Lse + lse, m_i + tl.log2(l_i), mask=head_mask)


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_reduce_kernel(
    Mid_O,
    Mid_Lse,
    Out,  # [num_tokens, num_heads, head_dim]
    q_rows,
    kv_indptr,
    num_splits,
    window,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    stride_lse_t,
    stride_lse_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    seq_len = tl.load(kv_indptr + req + 1) - tl.load(kv_indptr + req)
    keys = tl.where(window > 0, tl.minimum(seq_len, window), seq_len)  # as stage 1 splits
    split_len = tl.cdiv(keys, num_splits)
    used_splits = tl.cdiv(keys, split_len)  # the non-empty ones, all in front

    m = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, used_splits):
        mid = req * stride_mid_t + head * stride_mid_h + split * stride_mid_s
        lse = tl.load(Mid_Lse + req * stride_lse_t + head * stride_lse_h + split)
        part = tl.load(Mid_O + mid + offs_d, mask=d_mask, other=0.0)
        m, total, acc = fold_partial(m, total, acc, lse, part)
    out = (acc / total).to(Out.dtype.element_ty)
    tl.store(Out + tl.load(q_rows + req) * stride_ot + head * stride_oh + offs_d, out, mask=d_mask)


def _launch_split_kernel(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    q_rows: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    options: LaunchOptions | None,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor | None,
    merged: tuple[torch.Tensor, torch.Tensor] | None = None,
    overlap_writer: bool = False,
    layer: LayerAttention = FULL_ATTENTION,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Stage 1 into `partials` (mid_out, mid_lse), or else in one split straight into `out`,
    folding in the `merged` (mid_out, mid_lse) partials first where given; with
    `overlap_writer`, launched as a programmatic dependent of the kernel just before it
    (see decode_merged). `layer`: its window and soft-cap; `kv_scale`: an FP8 pool's."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group_size = num_heads // num_kv_heads
    if partials is not None:
        mid_out, mid_lse = partials
        assert mid_out.stride(3) == 1 and mid_lse.stride(2) == 1
        num_splits = mid_out.shape[2]
        strides = (*mid_out.stride()[:3], *mid_lse.stride()[:2], 0, 0)
        out = mid_out  # a placeholder: not written with DIRECT off
    elif merged is not None:
        assert out is not None and out.stride(2) == 1
        mid_out, mid_lse = merged
        assert mid_out.stride(3) == 1 and mid_lse.stride(2) == 1
        num_splits = 1
        strides = (*mid_out.stride()[:3], *mid_lse.stride()[:2], out.stride(0), out.stride(1))
    else:
        assert out is not None and out.stride(2) == 1
        num_splits = 1
        strides = (0, 0, 0, 0, 0, out.stride(0), out.stride(1))
        mid_out = mid_lse = out  # placeholders: not written with DIRECT on
    grid = (q_rows.shape[0], num_kv_heads * triton.cdiv(group_size, _BLOCK_H), num_splits)
    options = options or launch_options(num_splits, math.prod(grid), num_sms(q.device))
    dependent = overlap_writer and merged is not None and programmatic_launch(q.device)
    _decode_split_kernel[grid](
        q,
        q_rows,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        mid_out,
        mid_lse,
        out,
        scale * LOG2E,
        num_splits,
        layer.window or 0,
        (layer.soft_cap or 1.0) * LOG2E,
        kv_scale.k,
        kv_scale.v,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        *strides,
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=_BLOCK_H,
        BLOCK_N=options.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        DIRECT=partials is None,
        MERGE_SPLITS=0 if merged is None else merged[0].shape[2],
        WAIT_TO_MERGE=dependent,
        SOFT_CAP=layer.soft_cap is not None,
        KV_FP8=kv_fp8(k_buffer),
        launch_pdl=dependent,
        num_warps=options.num_warps,
        num_stages=options.num_stages,
    )


def decode_partials(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    q_rows: torch.Tensor,  # [bs] int64, the token row of each decoding request
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mid_out: torch.Tensor,  # [bs, num_heads, num_splits, head_dim] fp32 scratch
    mid_lse: torch.Tensor,  # [bs, num_heads, num_splits] fp32 scratch, contiguous splits
    scale: float,
    *,
    options: LaunchOptions | None = None,
    layer: LayerAttention = FULL_ATTENTION,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Stage 1 alone: each (request, head, split)'s partial output and lse in mid_out and
    mid_lse (splits past a short sequence's last are not written). `options` default to
    `launch_options`; others are for lab/probes/decode_attention.py's sweep."""
    _launch_split_kernel(
        q, k_buffer, v_buffer, q_rows, kv_indptr, kv_indices, scale, options,
        (mid_out, mid_lse), None, layer=layer, kv_scale=kv_scale,
    )  # fmt: skip


def decode_merged(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; the q_rows rows are written
    q_rows: torch.Tensor,  # [bs] int64
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mid_out: torch.Tensor,  # [bs, num_heads, splits, head_dim] fp32: partials written before
    mid_lse: torch.Tensor,  # [bs, num_heads, splits] fp32, -inf where a split was not written
    scale: float,
    *,
    options: LaunchOptions | None = None,
    overlap_writer: bool = False,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """One split over each request's KV, merged with the partials already in mid_out /
    mid_lse (e.g. a shared prefix's), written to `out`: attention over both parts.

    `overlap_writer`: the kernel launched just before this one wrote the partials (and
    nothing else this one reads) and releases its dependents (shared_prefix_attention
    does). Then on Hopper this kernel starts while that one's last programs run: it
    attends over the suffixes, and waits for that kernel only to fold the partials in.
    """
    _launch_split_kernel(
        q, k_buffer, v_buffer, q_rows, kv_indptr, kv_indices, scale, options, None, out,
        (mid_out, mid_lse), overlap_writer, kv_scale=kv_scale,
    )  # fmt: skip


def decode_reduce(
    mid_out: torch.Tensor,  # [bs, num_heads, num_splits, head_dim] from decode_partials
    mid_lse: torch.Tensor,  # [bs, num_heads, num_splits]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; the q_rows rows are written
    q_rows: torch.Tensor,
    kv_indptr: torch.Tensor,
    window: int | None = None,
) -> None:
    """Stage 2 alone: each request's written splits merged into its row of `out` (over
    the keys of its `window`, as stage 1 split them)."""
    bs, num_heads, num_splits, head_dim = mid_out.shape
    _decode_reduce_kernel[(bs, num_heads)](
        mid_out,
        mid_lse,
        out,
        q_rows,
        kv_indptr,
        num_splits,
        window or 0,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=4 if head_dim > 64 else 2,
    )


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; the q_rows rows are written
    q_rows: torch.Tensor,  # [bs] int64, the token row of each decoding request
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mid_out: torch.Tensor,  # [bs, num_heads, num_splits, head_dim] fp32 scratch
    mid_lse: torch.Tensor,  # [bs, num_heads, num_splits] fp32 scratch, contiguous splits
    scale: float,
    *,
    options: LaunchOptions | None = None,
    layer: LayerAttention = FULL_ATTENTION,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Both stages; with one split (mid_out.shape[2] == 1), stage 1 alone writing `out`
    (the scratch is then not used). `layer`: its window and soft-cap; `kv_scale`: an
    FP8 pool's scales for this layer."""
    if mid_out.shape[2] == 1:
        _launch_split_kernel(
            q, k_buffer, v_buffer, q_rows, kv_indptr, kv_indices, scale, options, None, out,
            layer=layer, kv_scale=kv_scale,
        )  # fmt: skip
        return
    decode_partials(
        q, k_buffer, v_buffer, q_rows, kv_indptr, kv_indices, mid_out, mid_lse, scale,
        options=options, layer=layer, kv_scale=kv_scale,
    )  # fmt: skip
    decode_reduce(mid_out, mid_lse, out, q_rows, kv_indptr, layer.window)
