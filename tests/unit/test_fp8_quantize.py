"""The FP8 quantize / dequantize helpers (engine/kernels/fp8.py) against compressed-tensors'
own quantizer (what llm-compressor writes checkpoints with), and the CPU path of the FP8
projections against the torch ops over the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.engine.kernels import linear as linear_ops
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.fp8 import (
    dequantize,
    quantize_rows,
    quantize_tokens,
    quantize_weight,
)
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from radixserve.engine.kernels.norm import fused_add_rms_norm_torch


def _rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]
    x[1] = 0.0  # an all-zero row takes MIN_SCALE, not a division by zero
    return x.to(torch.bfloat16)


def test_quantize_rows_matches_compressed_tensors() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    x = _rows(6, 300)
    codes, scale = quantize_rows(x)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32
    expected_scale = (x.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    assert torch.equal(scale, expected_scale)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    theirs = quantize(x.float(), scale[:, None], torch.zeros_like(scale[:, None]), args, FP8_DTYPE)
    assert torch.equal(codes.view(torch.uint8), theirs.view(torch.uint8))
    # Each row's largest magnitude lands on the largest code.
    assert torch.equal(codes.float().abs().amax(dim=1)[[0, 2, 3]], torch.full((3,), FP8_MAX))
    assert torch.equal(codes[1].float(), torch.zeros(300))


def test_dequantize_is_within_half_a_code() -> None:
    """Round to nearest: each weight within half a step of e4m3 (2^-4 of itself in the
    normal range, 2^-10 of the scale among subnormals) of its dequantized value."""
    weight = _rows(8, 96, seed=1).float()
    fp8 = quantize_weight(weight)
    error = (dequantize(fp8, torch.float32) - weight).abs()
    bound = torch.maximum(weight.abs() * 2**-4, fp8.scale[:, None] * 2**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert dequantize(fp8, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_tokens_on_the_cpu_is_per_row() -> None:
    x = _rows(5, 64)
    codes, scale = quantize_tokens(x)
    ref_codes, ref_scale = quantize_rows(x)
    assert scale.shape == (5, 1) and torch.equal(scale[:, 0], ref_scale)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_projections_over_an_fp8_weight_on_the_cpu(dtype: torch.dtype, tokens: int) -> None:
    """kernels/linear.py hands an Fp8Weight to the FP8 kernels: on the CPU the torch ops
    over the weight dequantized to the activations' dtype, norm and SiLU x mul as for a
    16-bit weight."""
    fp8 = quantize_weight(_rows(2 * 48, 64, seed=2).float())
    wide = dequantize(fp8, dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    residual = torch.randn_like(x)
    bias = torch.randn(2 * 48).to(dtype)
    norm_w = torch.rand(64).to(dtype) + 0.5
    assert torch.equal(linear_ops.linear(x, fp8, bias), F.linear(x, wide, bias))
    act, summed = linear_ops.add_norm_linear(x, residual, norm_w, 1e-5, fp8, None, gated=True)
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, 1e-5)
    assert torch.equal(summed, ref_sum)
    assert torch.equal(act, silu_and_mul_torch(F.linear(normed, wide)))
    out = torch.empty(tokens, 2 * 48, dtype=dtype)
    y, _ = linear_ops.add_norm_linear(x, None, norm_w, 1e-5, fp8, bias, out=out)
    assert y is out
