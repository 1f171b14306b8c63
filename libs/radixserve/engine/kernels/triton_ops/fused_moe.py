"""The fused MoE's grouped GEMM (kernels/moe.py), in the shape of vLLM's / SGLang's
`fused_moe_kernel`: each program takes BLOCK_M rows of the expert-sorted (token, slot)
pairs (moe_align_block_size) and BLOCK_N columns of their block's expert.

Two launches: gate_up with SiLU x mul fused (both halves' tiles in one program, so the
[pairs, 2n] projection is never written), then down with the routing weight applied;
the sum over top-k is torch's. Rounding follows the reference: the gate and up
projections to the input dtype, then silu_mul as kernels/activation.py rounds; the
down projection to the dtype, then its product with the weight.

FP8 experts (kernels/fp8.py's per-row form, stacked: codes [experts, rows, k] and a
float32 scale per row): W8A8 under an FP8 constexpr (16-bit experts compile as
before). Each launch's input rows are quantized per row first (kernels/fp8.
quantize_tokens: x for gate_up, the activations for down), the codes multiplied on the
FP8 tensor cores (Hopper has no direct e4m3 -> bf16 conversion to widen them cheaply),
and both scales applied to the float32 sums before the rounding above, as
triton_ops/gemv.py's `gemv_rows_fp8_triton` does for dense layers.

CUDA graphs: every buffer is sized by the token count and the largest padding
(max_padded_rows), the grid covers all its blocks and blocks past the rows in use
(read from the device) return at once; no host sync, nothing data-sized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import INTERPRETED, dot_precision
from radixserve.engine.kernels.fp8 import Fp8Weight, quantize_tokens
from radixserve.engine.kernels.moe_align import AlignedRoutes, moe_align_block_size
from radixserve.engine.kernels.triton_ops.activation import silu_mul


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int


# vLLM's defaults without a tuned table: small blocks of rows while tokens are no more
# than experts (most runs then hold a token or two), larger ones with L2-friendly
# grouping beyond.
_FEW_TOKENS = TileConfig(block_m=16, block_n=32, block_k=64, group_m=1)
_MANY_TOKENS = TileConfig(block_m=64, block_n=64, block_k=32, group_m=8)


def tile_config(tokens: int, num_experts: int) -> TileConfig:
    return _FEW_TOKENS if tokens <= num_experts else _MANY_TOKENS


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, INTERPRETED_DOT: tl.constexpr):
    """acc + a @ b. The interpreter's dot reads 16-bit (and 8-bit) floats as raw
    integers: float32 operands give the same exact products the tensor cores form (as
    triton_ops/gemv.py)."""
    if INTERPRETED_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _grouped_gemm_kernel(
    A,
    B,
    C,
    AScale,  # with FP8: float32 per row of A
    BScale,  # with FP8: float32 per row of each expert's B, [experts, rows]
    Weights,
    SortedIds,
    BlockExperts,
    NumPadded,
    N,
    K,
    num_rows,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_cm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,  # A and B e4m3 codes, their scales applied to the float32 sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    """C[pair] = A[pair // TOP_K] @ B[expert].T over the sorted pairs: with GATED, B holds
    2N rows (gate then up) and C = silu(gate) * up; else C is scaled by the pair's
    routing weight."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(num_rows, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks sweep the columns together, so their expert's tiles stay in L2.
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m).to(tl.int64)
    valid = pair < num_pairs
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, INTERPRETED_DOT)
        if GATED:
            up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            acc_up = _dot(a, up, acc_up, DOT_PRECISION, INTERPRETED_DOT)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if FP8:
        a_scale = tl.load(AScale + pair // TOP_K, mask=valid, other=0.0)[:, None]
        b_scales = BScale + expert * stride_bse + offs_n
        acc = acc * a_scale * tl.load(b_scales, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * a_scale * tl.load(b_scales + N, mask=n_mask, other=0.0)[None, :]
    dtype = C.dtype.element_ty
    if GATED:
        out = silu_mul(
            acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype, LIBDEVICE_EXP
        )
    else:
        weight = tl.load(Weights + pair, mask=valid, other=0.0).to(tl.float32)
        out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    c_ptrs = C + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor | Fp8Weight,
    c: torch.Tensor,
    routes: AlignedRoutes,
    config: TileConfig,
    top_k: int,
    weights: torch.Tensor | None,
) -> None:
    """One launch over `routes`: gate_up with SiLU x mul without `weights`, else down
    scaled by them. An FP8 `b` takes `a` quantized per row (W8A8)."""
    data, b_scale = (b.data, b.scale) if isinstance(b, Fp8Weight) else (b, None)
    a_scale: torch.Tensor | None = None
    if b_scale is not None:
        a, a_scale = quantize_tokens(a)
    n = c.shape[1]
    rows = routes.sorted_ids.numel()
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        data,
        c,
        c if a_scale is None else a_scale,  # the scales are read with FP8 only
        c if b_scale is None else b_scale,
        c if weights is None else weights,  # not read when GATED
        routes.sorted_ids,
        routes.block_experts,
        routes.num_padded,
        n,
        data.shape[2],
        rows,
        c.shape[0],
        a.stride(0),
        data.stride(0),
        data.stride(1),
        data.stride(2),
        0 if b_scale is None else b_scale.stride(0),
        c.stride(0),
        TOP_K=top_k,
        GATED=weights is None,
        FP8=b_scale is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        DOT_PRECISION=dot_precision(a.dtype),
        INTERPRETED_DOT=INTERPRETED,
        LIBDEVICE_EXP=not INTERPRETED,
        num_warps=4,
        num_stages=3,
    )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """kernels/moe.fused_moe on the Triton kernels (shapes checked there); FP8 weights
    contiguous (as loaded)."""
    tokens, hidden = x.shape
    experts, width, _ = w13.shape
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    config = tile_config(tokens, experts)
    routes = moe_align_block_size(topk_ids, experts, config.block_m)
    pairs = tokens * top_k
    act = torch.empty((pairs, width // 2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, routes, config, top_k, None)
    down = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, down, routes, config, 1, weights)
    return down.view(tokens, top_k, hidden).sum(dim=1)
