"""The GEMVs over FP8 weights (engine/kernels/triton_ops/gemv.py with weight_scale) under
the Triton interpreter on the CPU (compiled on CUDA): float8_e4m3fn rows times their
scales against the float64 projection over the dequantized weight (kernels/fp8.py),
with the norm prologues and the gated epilogue of the one-token GEMV, and the few-token
W8A8 GEMV (tokens quantized per row) against the projection of the dequantized tokens;
odd shapes exercise the masks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize, quantize_tokens, quantize_weight
from radixserve.engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from radixserve.engine.kernels.triton_ops import gemv
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device(round_bf16=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
SHAPES = [(37, 96), (130, 300), (8, 9000)]  # as test_gemv.py's: masks, blocks, long rows


def _fp8_weight(n: int, k: int) -> Fp8Weight:
    weight = cases.randn((n, k), torch.float32, DEVICE, seed=2) * k**-0.5
    # Rows of unlike magnitudes: a scale applied to the wrong row shows.
    weight *= torch.linspace(0.1, 4.0, n, device=DEVICE)[:, None]
    return quantize_weight(weight)


def _reference(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return cases.project_f64(x, dequantize(weight, torch.float64), bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_plain(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    weight = _fp8_weight(n, k)
    x = cases.randn((1, k), dtype, DEVICE, seed=1)
    b = cases.randn((n,), dtype, DEVICE, seed=3) if bias else None
    out = gemv.gemv_triton(x, weight.data, b, weight_scale=weight.scale)
    cases.assert_close_projection(out, _reference(x, weight, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_one_token_add_norm(dtype: torch.dtype, gated: bool) -> None:
    """The residual add and norm folded in; gated: gate and up rows each scaled by their
    own row's scale before SiLU x mul."""
    n, k = 130, 300
    weight = _fp8_weight(2 * n if gated else n, k)
    x = cases.randn((1, k), dtype, DEVICE, seed=1)
    residual = cases.randn((1, k), dtype, DEVICE, seed=4)
    norm_w = (1 + 0.1 * cases.randn((k,), torch.float32, DEVICE, seed=7)).to(dtype)
    summed = torch.empty_like(x)
    out = gemv.gemv_triton(
        x,
        weight.data,
        None,
        gemv.ADD_NORM,
        residual=residual,
        residual_out=summed,
        norm_weight=norm_w,
        eps=EPS,
        gated=gated,
        weight_scale=weight.scale,
    )
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    assert torch.equal(summed, ref_sum)
    ref = _reference(normed, weight, None)
    cases.assert_close_projection(out, silu_and_mul_torch(ref) if gated else ref)


def test_one_token_norm() -> None:
    n, k = 37, 96
    weight = _fp8_weight(n, k)
    x = cases.randn((1, k), torch.bfloat16, DEVICE, seed=1)
    norm_w = torch.ones(k, dtype=torch.bfloat16, device=DEVICE)
    out = gemv.gemv_triton(
        x, weight.data, None, gemv.NORM, norm_weight=norm_w, eps=EPS, weight_scale=weight.scale
    )
    cases.assert_close_projection(out, _reference(rms_norm_torch(x, norm_w, EPS), weight, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [2, 16, 27])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_w8a8(dtype: torch.dtype, n: int, k: int, m: int, bias: bool) -> None:
    """The tokens quantized per row, codes x codes, both scales: against the float64
    projection of the dequantized tokens over the dequantized weight."""
    weight = _fp8_weight(n, k)
    x = cases.randn((m, k), dtype, DEVICE, seed=8)
    # Tokens of unlike magnitudes: a scale applied to the wrong token shows.
    x *= torch.linspace(0.2, 5.0, m, device=DEVICE, dtype=dtype)[:, None]
    b = cases.randn((n,), dtype, DEVICE, seed=3) if bias else None
    codes, scale = quantize_tokens(x)
    out = gemv.gemv_rows_fp8_triton(codes, scale, weight.data, weight.scale, b, dtype)
    assert out.dtype == dtype
    tokens = Fp8Weight(codes, scale.view(-1))  # the same row-times-scale form
    ref = _reference(dequantize(tokens, torch.float64), weight, b).to(dtype)
    cases.assert_close_projection(out, ref)


def test_scales_must_come_with_fp8_weights() -> None:
    weight = _fp8_weight(37, 96)
    x = cases.randn((1, 96), torch.bfloat16, DEVICE, seed=1)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        gemv.gemv_triton(x, weight.data, None)
    with pytest.raises(ValueError, match=r"float32 \[37\]"):
        gemv.gemv_triton(x, weight.data, None, weight_scale=weight.scale[:36])
    codes, scale = quantize_tokens(torch.cat([x, x]))
    with pytest.raises(ValueError, match="goes with an FP8 weight"):
        gemv.gemv_rows_fp8_triton(
            codes, scale, dequantize(weight, torch.bfloat16), weight.scale, None, torch.bfloat16
        )
    with pytest.raises(ValueError, match="e4m3 token codes"):
        gemv.gemv_rows_fp8_triton(
            torch.cat([x, x]), scale, weight.data, weight.scale, None, torch.bfloat16
        )
    with pytest.raises(ValueError, match="a weight of theirs"):
        gemv.gemv_rows_triton(torch.cat([x, x]), weight.data, None)
