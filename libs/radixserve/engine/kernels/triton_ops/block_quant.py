"""Triton kernels over block-quantized weights (kernels/block_quant.py's BlockQuantWeight):
a GEMV for one token, a few-token GEMV on the tensor cores, and a dequantize kernel for
the passes past them.

Each kernel reads a tile of codes and widens it in registers: a 4-bit byte j holds row
elements 2j (low nibble) and 2j + 1 (high), so a tile of bytes is two tiles of weights,
the even and the odd elements, multiplied with the input's even and odd elements (no
interleave in registers). Element e's scale (and min) is that of block e // BLOCK, the
same for both nibbles of a byte (blocks are 16 or 32 wide). A weight is scale * q + min
in float32, as the torch reference computes it (q * scale is exact, so a fused
multiply-add rounds as they do), then, for the tensor cores, rounded to the activations'
dtype. As gemv.py's GEMVs: one program per BLOCK_N rows, no split over K, float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import INTERPRETED, interpreted_rows
from radixserve.engine.kernels.block_format import BlockQuantWeight
from radixserve.engine.kernels.dispatch import TENSOR_CORE_DTYPES


@triton.jit
def _weights(
    Codes,
    Scales,
    Mins,
    rows,
    rmask,
    js,
    jmask,
    K: tl.constexpr,
    WIDTH: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MINS: tl.constexpr,
):
    """(even, odd) float32 weights of `rows` at code columns `js` (4-bit: elements 2j and
    2j + 1; 8-bit: `even` is element j and `odd` unused)."""
    mask = rmask[:, None] & jmask[None, :]
    codes = tl.load(Codes + rows[:, None].to(tl.int64) * WIDTH + js[None, :], mask=mask, other=0)
    elements = js
    if BITS == 4:
        elements = 2 * js
    block_cols = rows[:, None].to(tl.int64) * (K // BLOCK) + (elements // BLOCK)[None, :]
    scale = tl.load(Scales + block_cols, mask=mask, other=0.0).to(tl.float32)
    offset = 0.0
    if HAS_MINS:
        offset = tl.load(Mins + block_cols, mask=mask, other=0.0).to(tl.float32)
    if BITS == 4:
        even = (codes & 0x0F).to(tl.float32) * scale + offset
        odd = (codes >> 4).to(tl.float32) * scale + offset
    else:
        even = codes.to(tl.float32) * scale + offset
        odd = even
    return even, odd


@triton.jit
def _gemv_kernel(
    X,
    Codes,
    Scales,
    Mins,
    Bias,
    Out,
    N,
    K: tl.constexpr,
    WIDTH: tl.constexpr,  # code columns: k / 2 (4-bit) or k
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,  # code columns a step (4-bit: bytes, two elements each)
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    for j0 in range(0, WIDTH, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        jmask = js < WIDTH
        even, odd = _weights(
            Codes, Scales, Mins, rows, rmask, js, jmask, K, WIDTH, BITS, BLOCK, HAS_MINS
        )
        if BITS == 4:
            x_even = tl.load(X + 2 * js, mask=jmask, other=0.0).to(tl.float32)
            x_odd = tl.load(X + 2 * js + 1, mask=jmask, other=0.0).to(tl.float32)
            acc += even * x_even[None, :] + odd * x_odd[None, :]
        else:
            acc += even * tl.load(X + js, mask=jmask, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=rmask)


def gemv_triton(
    x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T (+ bias) for one token x [1, k] -> [1, n] in x's dtype."""
    n, k = _check(x, weight)
    if x.shape[0] != 1:
        raise ValueError(f"gemv takes one token, got {tuple(x.shape)}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n = interpreted_rows(4, n)
    block_j = min(512, triton.next_power_of_2(weight.codes.shape[1]))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        *_blocks(weight),
        x if bias is None else bias,
        out,
        n,
        K=k,
        WIDTH=weight.codes.shape[1],
        BITS=weight.bits,
        BLOCK=weight.block,
        HAS_MINS=weight.mins is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_J=block_j,
        num_warps=4,
    )
    return out


@triton.jit
def _gemv_rows_kernel(
    X,
    Codes,
    Scales,
    Mins,
    Bias,
    Out,
    M,
    N,
    stride_x,
    stride_out,
    K: tl.constexpr,
    WIDTH: tl.constexpr,  # code columns: k / 2 (4-bit) or k
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
):
    """out[:M] = x[:M] @ W.T: each program's weight tiles widened once for all tokens
    (padded to BLOCK_T with zeros) and multiplied on the tensor cores."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < M
    dtype = X.dtype.element_ty
    x_rows = X + toks[:, None] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for j0 in range(0, WIDTH, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        jmask = js < WIDTH
        xmask = tmask[:, None] & jmask[None, :]
        even, odd = _weights(
            Codes, Scales, Mins, rows, rmask, js, jmask, K, WIDTH, BITS, BLOCK, HAS_MINS
        )
        cols = js
        if BITS == 4:
            cols = 2 * js
        acc = _dot(
            even.to(dtype),
            tl.load(x_rows + cols[None, :], mask=xmask, other=0.0),
            acc,
            INTERPRETED_DOT,
        )
        if BITS == 4:
            x_odd = tl.load(x_rows + cols[None, :] + 1, mask=xmask, other=0.0)
            acc = _dot(odd.to(dtype), x_odd, acc, INTERPRETED_DOT)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = Out + toks[None, :] * stride_out + rows[:, None]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


@triton.jit
def _dot(w, x, acc, INTERPRETED_DOT: tl.constexpr):
    if INTERPRETED_DOT:
        # The interpreter's dot reads 16-bit floats as raw integers (gemv.py): float32
        # operands give the same exact products the tensor cores form.
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


def gemv_rows_triton(
    x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T (+ bias) for a few tokens x [m, k] of a 16-bit dtype -> [m, n]. Each
    program holds all m tokens' sums: for small m only (kernels/block_quant.py decides)."""
    n, k = _check(x, weight)
    m = x.shape[0]
    if x.dtype not in TENSOR_CORE_DTYPES:
        raise ValueError(f"gemv_rows takes bfloat16 or float16 rows, got {x.dtype}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = interpreted_rows(32 if n >= 2048 else 16, n)
    # At least 16 code columns (the dot's depth), at most 128 a step.
    block_j = max(16, min(128, triton.next_power_of_2(weight.codes.shape[1])))
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        *_blocks(weight),
        x if bias is None else bias,
        out,
        m,
        n,
        x.stride(0),
        out.stride(0),
        K=k,
        WIDTH=weight.codes.shape[1],
        BITS=weight.bits,
        BLOCK=weight.block,
        HAS_MINS=weight.mins is not None,
        HAS_BIAS=bias is not None,
        BLOCK_T=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_J=block_j,
        INTERPRETED_DOT=INTERPRETED,
        num_warps=4,
        num_stages=3,
    )
    return out


@triton.jit
def _dequantize_kernel(
    Codes,
    Scales,
    Mins,
    Out,
    N,
    K: tl.constexpr,
    WIDTH: tl.constexpr,  # code columns: k / 2 (4-bit) or k
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    rmask = rows < N
    jmask = js < WIDTH
    even, odd = _weights(
        Codes, Scales, Mins, rows, rmask, js, jmask, K, WIDTH, BITS, BLOCK, HAS_MINS
    )
    dtype = Out.dtype.element_ty
    mask = rmask[:, None] & jmask[None, :]
    cols = js
    if BITS == 4:
        cols = 2 * js
    out = Out + rows[:, None].to(tl.int64) * K + cols[None, :]
    tl.store(out, even.to(dtype), mask=mask)
    if BITS == 4:
        tl.store(out + 1, odd.to(dtype), mask=mask)


def dequantize_triton(weight: BlockQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [n, k] in `dtype` (as block_quant.dequantize_torch computes it)."""
    n, k = weight.shape
    if not all(t is None or t.is_contiguous() for t in weight):
        raise ValueError("dequantize takes contiguous codes, scales and mins")
    out = torch.empty((n, k), dtype=dtype, device=weight.codes.device)
    block_n, block_j = interpreted_rows(16, n), 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(weight.codes.shape[1], block_j))
    _dequantize_kernel[grid](
        *_blocks(weight),
        out,
        n,
        K=k,
        WIDTH=weight.codes.shape[1],
        BITS=weight.bits,
        BLOCK=weight.block,
        HAS_MINS=weight.mins is not None,
        BLOCK_N=block_n,
        BLOCK_J=block_j,
        num_warps=4,
    )
    return out


def _blocks(weight: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' Codes, Scales, Mins (scales in place of absent mins: never read)."""
    mins = weight.scales if weight.mins is None else weight.mins
    return weight.codes, weight.scales, mins


def _check(x: torch.Tensor, weight: BlockQuantWeight) -> tuple[int, int]:
    n, k = weight.shape
    if not (x.dim() == 2 and x.shape[1] == k and x.stride(-1) == 1):
        raise ValueError(f"takes rows [m, {k}] with unit stride, got {tuple(x.shape)}")
    if not all(t is None or t.is_contiguous() for t in weight):
        raise ValueError("takes contiguous codes, scales and mins")
    return n, k
