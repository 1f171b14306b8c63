"""The decoder's projections with the elementwise op before them.

`add_norm_linear` (RMSNorm with the residual add, then a projection: qkv, the head; and
`gated`, gate_up then SiLU x mul) and `linear` (o, down).
For one token on CUDA each is a single Triton GEMV with the norm folded into its read
of the input and SiLU x mul into its output (triton_ops/gemv.py): at batch 1 a
projection streams its weight, and the norm and activation kernels between them, with
their launch gaps, were a share of a decode step worth saving
(lab/notebook/2026-11-23-token-gemvs-norms-silu-folded-projections.md).
From 2 to GEMV_MAX_ROWS tokens (`dispatch.gemv_wide_max_rows` over the wide weights:
gate_up, the head, 64 tokens on the H100, 48 on the H200; 16-bit dtypes, weights of
GEMV_ROWS_MIN_N rows or more) the op's kernel
(kernels/norm.py, activation.py) then the few-token Triton GEMV, which streams each
weight once for all the tokens on the tensor cores: cuBLAS's kernels for so few rows
(split over K, with a reduce kernel) read the weights slower (lab/notebook/2026-12-01-figures-from-code-comments.md). Otherwise the op's
kernel then cuBLAS, and on the CPU the torch reference. The GEMVs sum in float32 in
another order than cuBLAS, so outputs may differ from the unfused path by an ulp of the
output dtype in a few elements.
An FP8 weight (kernels/fp8.py's Fp8Weight, held by FP8 layers: model/quantization.py)
takes fp8.py's kernels instead, and a block-quantized one (a GGUF's blocks:
kernels/block_quant.py's BlockQuantWeight) block_quant.py's, chosen here from the
weight's type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.activation import silu_and_mul
from radixserve.engine.kernels.block_quant import (
    BlockQuantWeight,
    add_norm_linear_block_quant,
    linear_block_quant,
)
from radixserve.engine.kernels.dispatch import GEMV_MAX_ROWS, GEMV_WIDE_RATIO
from radixserve.engine.kernels.fp8 import Fp8Weight, add_norm_linear_fp8, linear_fp8
from radixserve.engine.kernels.norm import fused_add_rms_norm, rms_norm

# Weights of fewer rows leave most SMs idle in the few-token GEMV (one program per 16
# rows at least): cuBLAS splits them over K instead.
GEMV_ROWS_MIN_N = 1024


def _use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One token: the one-token GEMV (with the op before it folded in)."""
    return x.dim() == 2 and x.shape[0] == 1 and _gemv_operands(x, weight)


def _use_gemv_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """2 to GEMV_MAX_ROWS tokens (dispatch.gemv_wide_max_rows over a wide weight) of a
    16-bit dtype over a large enough weight: the few-token GEMV (after the op's own
    kernel)."""
    n, k = weight.shape
    if not (
        x.dim() == 2
        and x.shape[0] >= 2
        and n >= GEMV_ROWS_MIN_N
        and x.dtype in dispatch.TENSOR_CORE_DTYPES
        and _gemv_operands(x, weight)
    ):
        return False
    if n >= GEMV_WIDE_RATIO * k:
        return x.shape[0] <= dispatch.gemv_wide_max_rows(x.device)
    return x.shape[0] <= GEMV_MAX_ROWS


def _gemv_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA rows with unit stride and a contiguous weight of their dtype: what the GEMV
    kernels read."""
    return (
        dispatch.use_triton(x)
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    )


def _project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    if _use_gemv_rows(x, weight):
        from radixserve.engine.kernels.triton_ops import gemv

        return gemv.gemv_rows_triton(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.matmul(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def add_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Fp8Weight | BlockQuantWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual) for [tokens, k] rows; with residual
    None, (linear(rms_norm(x)), x). The projection is written into `out` when given.
    `gated` (gate_up): `weight` holds the gate rows, then the up rows, and the first
    result is silu(gate) * up of the projection [gate | up]."""
    if isinstance(weight, Fp8Weight):
        return add_norm_linear_fp8(x, residual, norm_weight, eps, weight, bias, out, gated=gated)
    if isinstance(weight, BlockQuantWeight):
        return add_norm_linear_block_quant(
            x, residual, norm_weight, eps, weight, bias, out, gated=gated
        )
    if _use_gemv(x, weight) and not (gated and weight.shape[0] % 2):
        # The one-token GEMV with the norm (and the residual add) folded into its read.
        from radixserve.engine.kernels.triton_ops import gemv

        summed = x if residual is None else torch.empty_like(x)
        y = gemv.gemv_triton(
            x,
            weight,
            bias,
            gemv.NORM if residual is None else gemv.ADD_NORM,
            residual=residual,
            residual_out=None if residual is None else summed,
            norm_weight=norm_weight,
            eps=eps,
            out=out,
            gated=gated,
        )
        return y, summed
    if residual is None:
        y, summed = _project(rms_norm(x, norm_weight, eps), weight, bias, out), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
        y = _project(normed, weight, bias, out)
    return (silu_and_mul(y) if gated else y), summed


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight | BlockQuantWeight,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), a GEMV for up to GEMV_MAX_ROWS tokens on CUDA (no split-K
    reduce kernel)."""
    if isinstance(weight, Fp8Weight):
        return linear_fp8(x, weight, bias)
    if isinstance(weight, BlockQuantWeight):
        return linear_block_quant(x, weight, bias)
    if _use_gemv(x, weight):
        from radixserve.engine.kernels.triton_ops import gemv

        return gemv.gemv_triton(x, weight, bias)
    return _project(x, weight, bias, None)
