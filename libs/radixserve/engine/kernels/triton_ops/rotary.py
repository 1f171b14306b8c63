"""Rotary kernel: one program per (token, head) of q and k together, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < NUM_Q_HEADS:
        src = Q + token * stride_qt + head * stride_qh
        dst = QOut + (token * NUM_Q_HEADS + head) * (2 * HALF)
    else:
        src = K + token * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        dst = KOut + (token * NUM_K_HEADS + head - NUM_Q_HEADS) * (2 * HALF)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = tl.load(Positions + token).to(tl.int64) * stride_table
    cos1 = tl.load(Cos + row + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + row + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], every product and the
    # sum rounded to the input dtype as torch rounds them.
    dtype = QOut.dtype.element_ty
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(dst + offs, out1.to(dtype), mask=mask)
    tl.store(dst + HALF + offs, out2.to(dtype), mask=mask)


def rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    half = head_dim // 2
    _rotary_kernel[(tokens, q_heads + k_heads)](
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
        NUM_Q_HEADS=q_heads,
        NUM_K_HEADS=k_heads,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1,
        enable_fp_fusion=False,  # float32: a fused multiply-add would round differently
    )
    return q_out, k_out
