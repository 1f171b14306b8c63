"""Block-quantized GGUF projections compiled on CUDA: the kernels of
kernels/triton_ops/block_quant.py at Llama-3.1-8B's shapes against the float64 product
over the torch reference's dequantized weight, each token-count path of
kernels/block_quant.py through kernels/linear.py, the engine's greedy tokens on a tiny
GGUF kept quantized (the CUDA default) against transformers' on its dequantized folder,
and the embedded SmolLM2 Q4_1's weights on the device at most 0.35x its float32 folder's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from gguf import GGMLQuantizationType as QType

from radixserve import Engine
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels import linear as linear_ops
from radixserve.engine.kernels.block_quant import BlockQuantWeight, dequantize_torch
from radixserve.engine.kernels.triton_ops import block_quant as kernels
from radixserve.engine.model.loader import load_model
from radixserve.model_files.gguf_blocks import common_layout, decode
from radixserve.model_files.gguf_convert import DEQUANTIZED, QUANTIZED, convert_gguf
from tests.helpers import fused_kernel_cases as cases
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)
from tests.unit.test_gguf_blocks import random_blocks, to_torch
from tests.unit.test_gguf_model import write_tiny_gguf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here"),
]

DEVICE = torch.device("cuda")
# Llama-3.1-8B's projections (n, k): qkv, o, down (gate_up is qkv's shape, wider).
SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336)]
LAYOUTS = {
    "q4_1": (QType.Q4_1,),
    "q4_k": (QType.Q4_K,),
    "q8_0": (QType.Q8_0,),
    "q4_k+q6_k": (QType.Q4_K, QType.Q6_K),
}


def _weight(layout: str, n: int, k: int) -> BlockQuantWeight:
    parts = [decode(random_blocks(t, n, k, seed=i), t) for i, t in enumerate(LAYOUTS[layout])]
    weight = to_torch(common_layout(parts)[-1])
    return BlockQuantWeight(*(None if t is None else t.to(DEVICE) for t in weight))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernels_at_llama_shapes(layout: str, n: int, k: int) -> None:
    weight = _weight(layout, n, k)
    wide = dequantize_torch(weight, torch.bfloat16)
    assert torch.equal(kernels.dequantize_triton(weight, torch.bfloat16), wide)
    x = cases.randn((1, k), torch.bfloat16, DEVICE, seed=1)
    ref = cases.project_f64(x, dequantize_torch(weight, torch.float64), None)
    cases.assert_close_projection(kernels.gemv_triton(x, weight, None), ref)
    rows = cases.randn((16, k), torch.bfloat16, DEVICE, seed=2)
    ref = cases.project_f64(rows, wide.double(), None)
    cases.assert_close_projection(kernels.gemv_rows_triton(rows, weight, None), ref)


@pytest.mark.parametrize("tokens", [1, 8, 32, 100])
def test_linear_dispatch(tokens: int) -> None:
    """One token, a few, and past GEMV_MAX_ROWS (dequantize, then cuBLAS)."""
    n, k = 4096, 4096
    weight = _weight("q4_1", n, k)
    x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=1)
    bias = cases.randn((n,), torch.bfloat16, DEVICE, seed=3)
    ref = cases.project_f64(x, dequantize_torch(weight, torch.bfloat16).double(), bias)
    cases.assert_close_projection(linear_ops.linear(x, weight, bias), ref)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf_cuda")
    # A lent GPU machine has no embedded GGUF to take the tokenizer from: one written
    # here comes with tools/device_carry.sh.
    carried = os.environ.get("RADIXSERVE_TEST_TINY_GGUF")
    path = Path(carried) if carried else write_tiny_gguf(root / "tiny.gguf")
    return convert_gguf(path, root / "cache", QUANTIZED), convert_gguf(
        path, root / "cache", DEQUANTIZED
    )


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_greedy_on_blocks(tiny_gguf: tuple[Path, Path], cuda_graph: bool) -> None:
    """float32: every path sums the same float32 weights in another order, so tokens agree
    with transformers' up to near-ties."""
    quantized, dequantized = tiny_gguf
    engine = Engine(
        model_path=str(quantized),
        device="cuda",
        dtype="float32",
        disable_cuda_graph=not cuda_graph,
        debug_check_invariants=True,
    )
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40])
    ours = engine_outputs(engine, prompts, 16)
    for out, ref in zip(ours, hf_greedy(dequantized, prompts, 16), strict=True):
        assert_matches_reference(out, ref)


def test_embedded_weights_on_device() -> None:
    from radixserve.model_files.paths import resolve_model_path

    try:
        resolve_model_path(None, gguf_weights=DEQUANTIZED)
    except FileNotFoundError as exc:  # a lent GPU machine has no embedded GGUF
        pytest.skip(str(exc))
    sizes = {}
    for weights in (QUANTIZED, DEQUANTIZED):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(DEVICE)
        model, _ = load_model(resolve_model_path(None, gguf_weights=weights), "float32", DEVICE)
        sizes[weights] = torch.cuda.memory_allocated(DEVICE) - before
        del model
    assert sizes[QUANTIZED] <= 0.35 * sizes[DEQUANTIZED]
