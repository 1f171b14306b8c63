"""Rotary kernel: one program per (token, head) of q and k together, in one launch.

With STORE the same launch also writes the step's KV: the programs of k's heads
store their rotated rows into the layer's K buffer at the token's slot as well, and
one more program per KV head copies the token's v row into the V buffer, each cast to
the buffer's dtype (what store_kv does after the rotary kernel, one launch fewer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.kernels.kv_store import KVWrite
from radixserve.engine.kernels.triton_ops.kv_store import check_store


@triton.jit
def _rotary_kernel(
    Q,
    stride_qt,
    stride_qh,
    K,
    stride_kt,
    stride_kh,
    QOut,
    KOut,
    Positions,
    Cos,
    Sin,
    stride_table,
    V,
    stride_vt,
    stride_vh,
    Loc,
    KBuf,
    VBuf,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    if head < NUM_Q_HEADS + NUM_K_HEADS:
        if head < NUM_Q_HEADS:
            src = Q + token * stride_qt + head * stride_qh
            dst = QOut + (token * NUM_Q_HEADS + head) * (2 * HALF)
        else:
            src = K + token * stride_kt + (head - NUM_Q_HEADS) * stride_kh
            dst = KOut + (token * NUM_K_HEADS + head - NUM_Q_HEADS) * (2 * HALF)
        row = tl.load(Positions + token).to(tl.int64) * stride_table
        cos1 = tl.load(Cos + row + offs, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(Cos + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(Sin + row + offs, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(Sin + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], every product and
        # the sum rounded to the input dtype as torch rounds them.
        dtype = QOut.dtype.element_ty
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        tl.store(dst + offs, out1.to(dtype), mask=mask)
        tl.store(dst + HALF + offs, out2.to(dtype), mask=mask)
        if STORE:
            if head >= NUM_Q_HEADS:
                slot = tl.load(Loc + token).to(tl.int64)
                k_cache = KBuf + (slot * NUM_K_HEADS + head - NUM_Q_HEADS) * (2 * HALF)
                cache_dtype = KBuf.dtype.element_ty
                tl.store(k_cache + offs, out1.to(dtype).to(cache_dtype), mask=mask)
                tl.store(k_cache + HALF + offs, out2.to(dtype).to(cache_dtype), mask=mask)
    elif STORE:  # the v programs (names apart: Triton merges names bound in both branches)
        v_head = head - NUM_Q_HEADS - NUM_K_HEADS
        v_slot = tl.load(Loc + token).to(tl.int64)
        v_src = V + token * stride_vt + v_head * stride_vh
        v_cache = VBuf + (v_slot * NUM_K_HEADS + v_head) * (2 * HALF)
        v1 = tl.load(v_src + offs, mask=mask)
        v2 = tl.load(v_src + HALF + offs, mask=mask)
        tl.store(v_cache + offs, v1.to(VBuf.dtype.element_ty), mask=mask)
        tl.store(v_cache + HALF + offs, v2.to(VBuf.dtype.element_ty), mask=mask)


def rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q and k as new contiguous tensors; with `store`, the rotated k and
    store.v are also written at store.loc of its buffers, in the same launch."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if (
        k.shape != (tokens, k_heads, head_dim)
        or q.stride(-1) != 1
        or k.stride(-1) != 1
        or head_dim % 2
        or cos.shape[-1] != head_dim
        or cos.stride() != sin.stride()
        or cos.stride(-1) != 1
        or k.dtype != q.dtype
        or cos.dtype != q.dtype
    ):
        raise ValueError(
            f"rotary takes q/k [tokens, heads, even head_dim] (last dim contiguous) and a "
            f"[positions, head_dim] table of their dtype; got q {tuple(q.shape)} {q.dtype}, "
            f"k {tuple(k.shape)}, table {tuple(cos.shape)} {cos.dtype}"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if store is None:  # the store arguments are never read: any tensors will do
        v, loc, k_buffer, v_buffer, heads = k, positions, k_out, k_out, q_heads + k_heads
    else:
        check_store(store.k_buffer, store.v_buffer, k, store.v)
        v, loc, k_buffer, v_buffer = store.v, store.loc, store.k_buffer, store.v_buffer
        heads = q_heads + 2 * k_heads
    half = head_dim // 2
    _rotary_kernel[(tokens, heads)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        q_out,
        k_out,
        positions,
        cos,
        sin,
        cos.stride(0),
        v,
        v.stride(0),
        v.stride(1),
        loc,
        k_buffer,
        v_buffer,
        NUM_Q_HEADS=q_heads,
        NUM_K_HEADS=k_heads,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        STORE=store is not None,
        num_warps=1,
        enable_fp_fusion=False,  # float32: a fused multiply-add would round differently
    )
    return q_out, k_out
