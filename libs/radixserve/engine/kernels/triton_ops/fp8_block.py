"""Block-wise FP8 projections (kernels/fp8.py, an Fp8Weight with a block): the tokens
quantized per group along k, and the block-scaled W8A8 GEMM over them.

- `quantize_token_groups_triton`: one program per (token, group of k): the group's
  absolute maximum -> scale max(absmax / FP8_MAX, MIN_SCALE), then codes = x / scale
  cast to e4m3, as the torch reference (the division is IEEE in both: bit for bit).
- `block_matmul_fp8_triton`: one program per BLOCK_M tokens x BLOCK_N weight rows; its
  k loop steps one weight block (bk) at a time, so each step's FP8 tensor-core sums
  (float32) take one token-group scale per row and one weight-block scale per column:
  acc += dot(a, w) * a_scale[m, kb] * w_scale[n // bn, kb] (SGLang's and vLLM's
  w8a8_block_fp8_matmul). No split-K and no few-token specialisation: one tile shape
  per token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_groups_kernel(
    X,
    Q,
    Scale,
    stride_x,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)
    kmask = ks < K
    x = tl.load(X + row * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_, MIN_SCALE_)
    tl.store(Scale + row * tl.num_programs(1) + group, scale)
    q = tl.clamp(x / scale, -FP8_MAX_, FP8_MAX_)
    tl.store(Q + row * K + ks, q.to(Q.dtype.element_ty), mask=kmask)


def quantize_token_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] float8_e4m3fn, scales [m, ceil(k / group)] float32) for rows x [m, k]
    (unit stride along k); `group` a power of two."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_token_groups takes rows with unit stride")
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_groups_kernel[(m, groups)](
        x,
        q,
        scale,
        x.stride(0),
        K=k,
        GROUP=group,
        FP8_MAX_=FP8_MAX,
        MIN_SCALE_=MIN_SCALE,
        num_warps=1 if group <= 256 else 4,
    )
    return q, scale


@triton.jit
def _block_matmul_kernel(
    A,  # [M, K] e4m3 codes of the tokens
    AScale,  # [M, ceil(K / BLOCK_K)] float32, one per token per group
    W,  # [N, K] e4m3 codes of the weight
    WScale,  # [ceil(N / SCALE_N), ceil(K / BLOCK_K)] float32, unit stride along k
    Bias,
    Out,  # [M, N]
    M,
    stride_wsn,
    N: tl.constexpr,
    K: tl.constexpr,
    K_BLOCKS: tl.constexpr,  # ceil(K / BLOCK_K)
    SCALE_N: tl.constexpr,  # the weight block's rows
    HAS_BIAS: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the weight block's columns, the tokens' group
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    a_scale_ptrs = AScale + offs_m.to(tl.int64) * K_BLOCKS
    w_scale_ptrs = WScale + (offs_n // SCALE_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_BLOCKS):
        kmask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if INTERPRETED_DOT:
            # The interpreter's dot reads 8-bit floats as raw integers; float32 operands
            # give the exact products the tensor cores form (as triton_ops/fused_moe.py).
            sums = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            sums = tl.dot(a, w)
        a_scale = tl.load(a_scale_ptrs + kb, mask=mmask, other=0.0)
        w_scale = tl.load(w_scale_ptrs + kb, mask=nmask, other=0.0)
        acc += sums * a_scale[:, None] * w_scale[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _block_m(m: int) -> int:
    # tl.dot takes 16 rows at least; past 64 tokens a wider tile reuses each weight tile.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def block_matmul_fp8_triton(
    codes: torch.Tensor,
    codes_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(codes * codes_scale per group) @ (weight * weight_scale per block).T (+ bias) ->
    [m, n] in `out_dtype`: codes [m, k] e4m3 with codes_scale [m, ceil(k / bk)]
    (quantize_token_groups with the weight's bk), a block-wise weight [n, k] e4m3 with
    weight_scale [ceil(n / bn), ceil(k / bk)] of unit stride along k (an Fp8Weight's)."""
    (n, k), (bn, bk) = weight.shape, block
    m = codes.shape[0]
    k_blocks = triton.cdiv(k, bk)
    if codes.shape != (m, k) or codes_scale.shape != (m, k_blocks):
        raise ValueError(
            f"tokens {tuple(codes.shape)} with scales {tuple(codes_scale.shape)} do not fit "
            f"a weight [{n}, {k}] of blocks ({bn}, {bk})"
        )
    if weight_scale.shape != (triton.cdiv(n, bn), k_blocks) or weight_scale.stride(1) != 1:
        raise ValueError(
            f"weight scale {tuple(weight_scale.shape)} (strides {weight_scale.stride()}) is "
            f"not one per ({bn}, {bk}) block of [{n}, {k}] with unit stride along k"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    block_m = _block_m(m)
    block_n = 128 if n >= 128 else 64
    _block_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        codes,
        codes_scale,
        weight,
        weight_scale,
        bias if bias is not None else out,
        out,
        m,
        weight_scale.stride(0),
        N=n,
        K=k,
        K_BLOCKS=k_blocks,
        SCALE_N=bn,
        HAS_BIAS=bias is not None,
        INTERPRETED_DOT=INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        num_warps=4,
        num_stages=1 if INTERPRETED else 3,
    )
    return out
