"""K/V store kernel: one program per token writes its K and V rows to their slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    Loc,
    KBuf,
    VBuf,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < DIM)
    dst = slot * HEADS * DIM + h * DIM + d
    k = tl.load(K + token * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(KBuf + dst, k.to(KBuf.dtype.element_ty), mask=mask)
    v = tl.load(V + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(VBuf + dst, v.to(VBuf.dtype.element_ty), mask=mask)


def check_store(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """The layouts the store kernels write: k/v rows of the buffers' row shape, each
    row's head_dim contiguous, into contiguous buffers."""
    heads, dim = k.shape[1:]
    if (
        v.shape != k.shape
        or k_buffer.shape[1:] != (heads, dim)
        or v_buffer.shape != k_buffer.shape
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        raise ValueError(
            f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, buffer {tuple(k_buffer.shape)}"
        )
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("store_kv writes contiguous KV buffers")


def store_kv_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    check_store(k_buffer, v_buffer, k, v)
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k,
        v,
        loc,
        k_buffer,
        v_buffer,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=4,
    )
