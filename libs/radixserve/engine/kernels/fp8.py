"""FP8 projections: float8_e4m3fn weights with one float32 scale per output row, or
one per block of the weight (block-wise FP8, DeepSeek-V3's layout).

An `Fp8Weight` is what kernels/linear.py's `linear` and `add_norm_linear` take in place
of a 16-bit weight; they hand it here, so a projection's kernel follows from what its
layer holds (model/quantization.py builds those layers). Row i of the weight is
data[i] * scale[i] (per-channel; a per-tensor checkpoint scale is broadcast on load);
with a `block` (bn, bk), element [i, j] is data[i, j] * scale[i // bn, j // bk].

Block-wise weights take one path at every batch size: on CUDA the tokens quantized per
token per group of bk along k (dynamic), then the block-scaled W8A8 GEMM
(triton_ops/fp8_block.py, FP8 tensor cores, both scales on each k-block's float32 sums);
elsewhere the weight dequantized for each call. The rest of this note is the per-row
form's.

On CUDA, by the tokens of the pass:
- one token over a weight of fewer than GEMV_WIDE_RATIO x k rows (qkv, o, down): the
  one-token Triton GEMV over the FP8 rows (the norm before qkv folded into its read, as
  the 16-bit path), activations in 16 bits, each code widened in registers;
- up to FP8_GEMV_MAX_ROWS tokens, and one over a wide weight (gate_up): the op's own
  kernel, per-token dynamic quantization of the activations (a Triton kernel: row
  absmax -> scale, cast to e4m3), then the few-token GEMV on the FP8 tensor cores
  (triton_ops/gemv.py `gemv_rows_fp8_triton`, W8A8, both scales on the float32 sums).
  Widening each code costs the one-token GEMV as much time as the 16-bit stream; the
  tensor cores read the codes as they are (lab/notebook/2026-12-02-fp8-few-token-w8a8.md);
- more: the same quantization, then `torch._scaled_mm` with row-wise scales (the
  tokens' and the weight rows'), bfloat16 out. Other dtypes, and shapes cuBLASLt's FP8
  GEMM does not take (k or n not a multiple of 16), multiply the dequantized weight.
Elsewhere (the CPU) the weight is dequantized to the activations' dtype for each call:
correctness only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.activation import silu_and_mul
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from radixserve.engine.kernels.norm import fused_add_rms_norm, rms_norm

# FP8 weights of fewer rows run cuBLASLt past one token: the few-token GEMV leaves most
# SMs idle on them (as the 16-bit path's limit, kernels/linear.py; not measured for FP8).
GEMV_ROWS_MIN_N = 1024
# Up to this many tokens the W8A8 few-token GEMV streams the weight faster than
# cuBLASLt's FP8 GEMM (lab/notebook/2026-12-02-fp8-few-token-w8a8.md).
FP8_GEMV_MAX_ROWS = 64


class Fp8Weight(NamedTuple):
    """A projection's FP8 weight: row i is data[i] * scale[i]; with a block (bn, bk),
    element [i, j] is data[i, j] * scale[i // bn, j // bk]."""

    data: torch.Tensor  # [n, k] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [n] float32; blocks: [ceil(n / bn), ceil(k / bk)], unit k stride
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn shaped as x, scales [rows] float32) for 2-D x: each row
    divided by its absmax / FP8_MAX and rounded to the nearest code, as llm-compressor
    quantizes a weight per channel (the torch reference of `quantize_tokens` too)."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    codes = (wide / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A 16- or 32-bit weight [n, k] quantized per output row."""
    data, scale = quantize_rows(weight)
    return Fp8Weight(data, scale)


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight the FP8 one stands for, in `dtype` (the product is exact in float32:
    a code has 4 significant bits, a bfloat16 or float32 scale at most 24 - 4)."""
    if weight.block is None:
        return (weight.data.float() * weight.scale[:, None]).to(dtype)
    (n, k), (bn, bk) = weight.shape, weight.block
    scale = weight.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.data.float() * scale).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] float8_e4m3fn, scales [m, 1] float32): rows x [m, k] quantized per
    token (dynamic activation scales): the Triton kernel on CUDA, else quantize_rows."""
    if dispatch.use_triton(x):
        from radixserve.engine.kernels.triton_ops.fp8 import quantize_tokens_triton

        return quantize_tokens_triton(x)
    codes, scale = quantize_rows(x)
    return codes, scale[:, None]


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] float8_e4m3fn, scales [m, ceil(k / group)] float32): rows x [m, k]
    quantized per token per group of `group` along k (the last group may be short), as
    SGLang's and vLLM's per_token_group_quant_fp8: the Triton kernel on CUDA, else torch."""
    if dispatch.use_triton(x):
        from radixserve.engine.kernels.triton_ops.fp8_block import quantize_token_groups_triton

        return quantize_token_groups_triton(x, group)
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    codes, scale = quantize_rows(padded.reshape(m * groups, group))
    return codes.view(m, groups * group)[:, :k].contiguous(), scale.view(m, groups)


def linear_fp8(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantize(weight).T (+ bias) for rows x [m, k] -> [m, n] in x's dtype, written
    into `out` when given."""
    y = _project(x, weight, bias)
    if out is None:
        return y
    return out.copy_(y)


def add_norm_linear_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/linear.add_norm_linear over an FP8 weight (the same contract)."""
    if _one_token_gemv(x, weight) and not (gated and weight.shape[0] % 2):
        from radixserve.engine.kernels.triton_ops import gemv

        summed = x if residual is None else torch.empty_like(x)
        y = gemv.gemv_triton(
            x,
            weight.data,
            bias,
            gemv.NORM if residual is None else gemv.ADD_NORM,
            residual=residual,
            residual_out=None if residual is None else summed,
            norm_weight=norm_weight,
            eps=eps,
            out=out,
            gated=gated,
            weight_scale=weight.scale,
        )
        return y, summed
    if residual is None:
        normed, summed = rms_norm(x, norm_weight, eps), x
    else:
        normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = linear_fp8(normed, weight, bias, out)
    return (silu_and_mul(y) if gated else y), summed


def _project(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.block is not None:
        return _project_blocks(x, weight, bias)
    if _one_token_gemv(x, weight):
        from radixserve.engine.kernels.triton_ops import gemv

        return gemv.gemv_triton(x, weight.data, bias, weight_scale=weight.scale)
    if _few_token_gemv(x, weight):
        from radixserve.engine.kernels.triton_ops import gemv

        codes, scale = quantize_tokens(x)
        return gemv.gemv_rows_fp8_triton(codes, scale, weight.data, weight.scale, bias, x.dtype)
    if _scaled_mm_operands(x, weight):
        codes, scale = quantize_tokens(x)
        y = torch._scaled_mm(
            codes,
            weight.data.t(),
            scale_a=scale,
            scale_b=weight.scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )
        return y if bias is None else y.add_(bias)
    return F.linear(x, dequantize(weight, x.dtype), bias)


def _project_blocks(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    assert weight.block is not None
    if dispatch.use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from radixserve.engine.kernels.triton_ops.fp8_block import block_matmul_fp8_triton

        codes, scale = quantize_token_groups(x, weight.block[1])
        return block_matmul_fp8_triton(
            codes, scale, weight.data, weight.scale, weight.block, bias, x.dtype
        )
    return F.linear(x, dequantize(weight, x.dtype), bias)


def _gemv_operands(x: torch.Tensor, weight: Fp8Weight) -> bool:
    return (
        weight.block is None
        and dispatch.use_triton(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and weight.data.is_contiguous()
        and weight.scale.is_contiguous()
    )


def _one_token_gemv(x: torch.Tensor, weight: Fp8Weight) -> bool:
    n, k = weight.shape
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and n < dispatch.GEMV_WIDE_RATIO * k
        and _gemv_operands(x, weight)
    )


def _few_token_gemv(x: torch.Tensor, weight: Fp8Weight) -> bool:
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= FP8_GEMV_MAX_ROWS
        and weight.shape[0] >= GEMV_ROWS_MIN_N
        and x.dtype in dispatch.TENSOR_CORE_DTYPES
        and _gemv_operands(x, weight)
    )


def _scaled_mm_operands(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """bfloat16 CUDA rows and a weight of k and n multiples of 16 (cuBLASLt's FP8 GEMM)."""
    n, k = weight.shape
    return (
        x.is_cuda
        and not dispatch.interpreting()
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and n % 16 == 0
        and k % 16 == 0
    )
