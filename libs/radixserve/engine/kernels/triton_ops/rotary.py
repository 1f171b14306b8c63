"""Rotary kernel: one program per token and part, in one launch: part 0 rotates the
token's q heads, part 1 its k heads, each as one [heads, head_dim / 2] block per
half, with the token's cos/sin row read once.

With STORE the same launch also writes the step's KV: part 1 stores the rotated k
rows into the layer's K buffer at the token's slot and copies the token's v rows into
the V buffer, each cast to the buffer's dtype (what store_kv does after the rotary
kernel, one launch fewer). Over a few tokens launched as a programmatic dependent on
Hopper (as kernels/triton_ops/norm.py says).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import few_token_dependent, start_as_dependent
from radixserve.engine.kernels.kv_store import KVWrite
from radixserve.engine.kernels.triton_ops.kv_store import check_store


@triton.jit
def _rotate(src, dst, mask, cos1, cos2, sin1, sin2, HALF: tl.constexpr):
    """Rotates the rows at src ([heads, half] pointers to their first halves) into
    dst; returns the two rotated halves in dst's dtype."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], every product and
    # the sum rounded to the input dtype as torch rounds them.
    dtype = dst.dtype.element_ty
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(dst, out1, mask=mask)
    tl.store(dst + HALF, out2, mask=mask)
    return out1, out2


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
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, BLOCK)[None, :]
    mask = offs < HALF
    row = tl.load(Positions + token).to(tl.int64) * stride_table
    cos1 = tl.load(Cos + row + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + row + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # Names apart in the two branches: Triton merges names bound in both.
    if part == 0:
        q_heads = tl.arange(0, BLOCK_Q_HEADS)[:, None]
        q_src = Q + token * stride_qt + q_heads * stride_qh + offs
        q_dst = QOut + (token * NUM_Q_HEADS + q_heads) * (2 * HALF) + offs
        _rotate(q_src, q_dst, (q_heads < NUM_Q_HEADS) & mask, cos1, cos2, sin1, sin2, HALF)
    else:
        k_heads = tl.arange(0, BLOCK_K_HEADS)[:, None]
        k_mask = (k_heads < NUM_K_HEADS) & mask
        k_src = K + token * stride_kt + k_heads * stride_kh + offs
        k_dst = KOut + (token * NUM_K_HEADS + k_heads) * (2 * HALF) + offs
        out1, out2 = _rotate(k_src, k_dst, k_mask, cos1, cos2, sin1, sin2, HALF)
        if STORE:
            slot = tl.load(Loc + token).to(tl.int64)
            k_cache = KBuf + (slot * NUM_K_HEADS + k_heads) * (2 * HALF) + offs
            tl.store(k_cache, out1.to(KBuf.dtype.element_ty), mask=k_mask)
            tl.store(k_cache + HALF, out2.to(KBuf.dtype.element_ty), mask=k_mask)
            dim = tl.arange(0, 2 * BLOCK)[None, :]  # whole v rows
            v_mask = (k_heads < NUM_K_HEADS) & (dim < 2 * HALF)
            v = tl.load(V + token * stride_vt + k_heads * stride_vh + dim, mask=v_mask)
            v_cache = VBuf + (slot * NUM_K_HEADS + k_heads) * (2 * HALF) + dim
            tl.store(v_cache, v.to(VBuf.dtype.element_ty), mask=v_mask)


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
        v, loc, k_buffer, v_buffer = k, positions, k_out, k_out
    else:
        check_store(store.k_buffer, store.v_buffer, k, store.v)
        v, loc, k_buffer, v_buffer = store.v, store.loc, store.k_buffer, store.v_buffer
    half = head_dim // 2
    block = triton.next_power_of_2(half)
    block_q_heads = triton.next_power_of_2(q_heads)
    pdl = few_token_dependent(q.device, tokens)
    _rotary_kernel[(tokens, 2)](
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
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_K_HEADS=triton.next_power_of_2(k_heads),
        HALF=half,
        BLOCK=block,
        STORE=store is not None,
        PDL=pdl,
        launch_pdl=pdl,
        # The q block is the larger: 4 warps for Llama's 32 heads x 64, fewer below.
        num_warps=min(max(block_q_heads * block // 512, 1), 4),
        enable_fp_fusion=False,  # float32: a fused multiply-add would round differently
    )
    return q_out, k_out
