"""The Triton kernels over block-quantized weights (engine/kernels/triton_ops/block_quant.py)
under the Triton interpreter on the CPU (compiled on CUDA): the one-token and few-token
GEMVs against the float64 projection over the torch reference's dequantized weight, and
the dequantize kernel against that reference bit for bit, for each layout (4-bit with
mins, 8-bit blocks of 32 and of 16, with and without mins, float16 and float32 scales);
odd row counts exercise the masks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from gguf import GGMLQuantizationType as QType

from radixserve.engine.kernels.block_quant import BlockQuantWeight, dequantize_torch
from radixserve.engine.kernels.triton_ops import block_quant as kernels
from radixserve.model_files.gguf_blocks import common_layout, decode
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.triton_interpreter import kernel_test_device
from tests.unit.test_gguf_blocks import random_blocks, to_torch

DEVICE = kernel_test_device(round_bf16=True)
# (name, GGUF types of the parts laid out together): each layout the kernels take.
LAYOUTS = {
    "q4_1": (QType.Q4_1,),
    "q4_0": (QType.Q4_0,),
    "q4_k": (QType.Q4_K,),  # float32 scales
    "q8_0": (QType.Q8_0,),
    "q6_k": (QType.Q6_K,),  # blocks of 16
    "q4_k+q6_k": (QType.Q4_K, QType.Q6_K),  # 8-bit, blocks of 16, with mins
}


def _weight(layout: str, n: int, k: int) -> BlockQuantWeight:
    parts = [decode(random_blocks(t, n, k, seed=i), t) for i, t in enumerate(LAYOUTS[layout])]
    weight = to_torch(common_layout(parts)[-1])
    return BlockQuantWeight(*(None if t is None else t.to(DEVICE) for t in weight))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_reference(layout: str, dtype: torch.dtype) -> None:
    weight = _weight(layout, 37, 512)
    assert torch.equal(kernels.dequantize_triton(weight, dtype), dequantize_torch(weight, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_one_token(layout: str, bias: bool) -> None:
    n, k = 37, 512
    weight = _weight(layout, n, k)
    for dtype in (torch.float32, torch.bfloat16):
        x = cases.randn((1, k), dtype, DEVICE, seed=1)
        b = cases.randn((n,), dtype, DEVICE, seed=3) if bias else None
        ref = cases.project_f64(x, dequantize_torch(weight, torch.float64), b)
        cases.assert_close_projection(kernels.gemv_triton(x, weight, b), ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [2, 5, 32])
def test_few_tokens(layout: str, tokens: int) -> None:
    """Weights rounded to bfloat16 in registers: the reference multiplies the bfloat16
    weights (what the 16-bit model of the dequantized file holds)."""
    n, k = 40, 256
    weight = _weight(layout, n, k)
    x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=1)
    b = cases.randn((n,), torch.bfloat16, DEVICE, seed=3)
    ref = cases.project_f64(x, dequantize_torch(weight, torch.bfloat16).double(), b)
    cases.assert_close_projection(kernels.gemv_rows_triton(x, weight, b), ref)


def test_shapes_are_checked() -> None:
    weight = _weight("q4_1", 8, 64)
    with pytest.raises(ValueError, match="rows"):
        kernels.gemv_triton(torch.zeros(1, 32, device=DEVICE), weight, None)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.gemv_rows_triton(torch.zeros(2, 64, device=DEVICE), weight, None)
