"""Block-quantized projections: a GGUF's 4- or 8-bit codes with a scale (and a min) per
block of 16 or 32 weights of a row, kept as the file stores them
(model_files/gguf_blocks.py says which GGUF types map to which layout).

A `BlockQuantWeight` is what kernels/linear.py's `linear` and `add_norm_linear` take in
place of a 16-bit weight (model/quantization.py's BlockQuantLinear holds one); element
(i, e) of the weight is scales[i, e // block] * q + mins[i, e // block], computed in
float32 (exact up to its one rounding, as gguf dequantizes) and rounded to the
activations' dtype.

On CUDA, by the tokens of the pass:
- one token: a Triton GEMV that widens the codes in registers (triton_ops/block_quant.py)
  after the op's own norm kernel; gate_up's SiLU x mul after it;
- up to GEMV_MAX_ROWS tokens of a 16-bit dtype: the few-token GEMV over the codes on the
  tensor cores (weights widened to the activations' dtype in registers);
- more: a Triton kernel dequantizes the weight to the activations' dtype, then cuBLAS
  (a transient weight of the projection's full size, one projection at a time).
Elsewhere (the CPU) the weight is dequantized with torch ops for each call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.activation import silu_and_mul
from radixserve.engine.kernels.block_format import BlockQuantWeight
from radixserve.engine.kernels.norm import fused_add_rms_norm, rms_norm


def dequantize(weight: BlockQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [n, k] in `dtype`: the Triton kernel on CUDA, else torch ops."""
    if dispatch.use_triton(weight.codes):
        from radixserve.engine.kernels.triton_ops.block_quant import dequantize_triton

        return dequantize_triton(weight, dtype)
    return dequantize_torch(weight, dtype)


def dequantize_torch(weight: BlockQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The reference: codes widened to float32, times their block's scale, plus its min."""
    codes = weight.codes
    n, k = weight.shape
    if weight.bits == 4:
        # Nibbles written straight into the float32 weight's even and odd elements:
        # several times faster on the CPU than stacking them first.
        q = torch.empty((n, k // 2, 2), dtype=torch.float32, device=codes.device)
        q[..., 0] = codes & 0x0F
        q[..., 1] = codes >> 4
    else:
        q = codes.to(torch.float32)
    wide = q.view(n, -1, weight.block).mul_(weight.scales.to(torch.float32).unsqueeze(-1))
    if weight.mins is not None:  # q * scale is exact: one rounding, as gguf's
        wide.add_(weight.mins.to(torch.float32).unsqueeze(-1))
    return wide.view(n, k).to(dtype)


def linear_block_quant(
    x: torch.Tensor,
    weight: BlockQuantWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ dequantize(weight).T (+ bias) for rows x [m, k] -> [m, n] in x's dtype, written
    into `out` when given."""
    y = _project(x, weight, bias)
    return y if out is None else out.copy_(y)


def add_norm_linear_block_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: BlockQuantWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/linear.add_norm_linear over a block-quantized weight (the same contract)."""
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, eps), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = linear_block_quant(normed, weight, bias, out)
    return (silu_and_mul(y) if gated else y), summed


def _project(x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if _gemv_operands(x, weight):
        from radixserve.engine.kernels.triton_ops import block_quant as kernels

        if x.shape[0] == 1:
            return kernels.gemv_triton(x, weight, bias)
        if x.shape[0] <= dispatch.GEMV_MAX_ROWS and x.dtype in dispatch.TENSOR_CORE_DTYPES:
            return kernels.gemv_rows_triton(x, weight, bias)
    return F.linear(x, dequantize(weight, x.dtype), bias)


def _gemv_operands(x: torch.Tensor, weight: BlockQuantWeight) -> bool:
    """CUDA rows with unit stride and contiguous blocks: what the GEMV kernels read."""
    return (
        dispatch.use_triton(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and all(t is None or t.is_contiguous() for t in weight)
    )
