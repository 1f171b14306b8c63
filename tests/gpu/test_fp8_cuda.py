"""FP8 projections compiled on CUDA (Hopper): the per-token quantization kernel against
its torch reference, each token-count path of kernels/fp8.py (one-token GEMV, few-token
GEMV, quantized activations through torch._scaled_mm) at Llama-3.1-8B's shapes against
the float64 product over the dequantized weight, a CUDA-graph replay, and the engine's
greedy tokens on an FP8 tiny model (float32: transformers' on the dequantized weights;
bfloat16 with and without CUDA graphs: within bfloat16's and FP8 activations' ties)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve import Engine
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels import linear as linear_ops
from radixserve.engine.kernels.dispatch import GEMV_WIDE_RATIO
from radixserve.engine.kernels.fp8 import dequantize, quantize_rows, quantize_weight
from radixserve.engine.kernels.triton_ops.fp8 import quantize_tokens_triton
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.fp8_checkpoints import write_dequantized, write_fp8_method
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here"),
]

DEVICE = torch.device("cuda")
# Llama-3.1-8B's projections (n, k): qkv, o, gate_up, down.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
# 1: the one-token GEMV; 2..32: the few-token GEMV; more: _scaled_mm.
TOKENS = [1, 2, 7, 32, 33, 64, 300]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return cases.randn((n, k), torch.float32, DEVICE, seed) * k**-0.5


def test_quantize_tokens_kernel_matches_the_reference() -> None:
    x = cases.randn((37, 14336), torch.bfloat16, DEVICE, seed=1)
    x[3] = 0.0
    x[5] *= 1000.0
    codes, scale = quantize_tokens_triton(x)
    ref_codes, ref_scale = quantize_rows(x)
    torch.testing.assert_close(scale[:, 0], ref_scale, rtol=1e-6, atol=0)
    # One code apart at most (a quotient on a rounding boundary), in a few elements.
    torch.testing.assert_close(codes.float(), ref_codes.float(), rtol=2**-3, atol=2**-9)
    assert (codes.view(torch.uint8) != ref_codes.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_projection_paths_match_the_dequantized_product(n: int, k: int) -> None:
    fp8 = quantize_weight(_weight(n, k))
    wide = dequantize(fp8, torch.float64)
    for tokens in TOKENS:
        x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=tokens)
        got = linear_ops.linear(x, fp8, None)
        assert got.shape == (tokens, n) and got.dtype == torch.bfloat16
        if tokens == 1 and n < GEMV_WIDE_RATIO * k:  # the one-token GEMV: bfloat16 in
            ref = (x.double() @ wide.t()).to(torch.bfloat16)
        else:  # activations quantized per token: the W8A8 GEMV or cuBLASLt's FP8 GEMM
            codes, scale = quantize_rows(x)
            ref = ((codes.double() * scale.double()[:, None]) @ wide.t()).to(torch.bfloat16)
        cases.assert_close_projection(got, ref)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_add_norm_gated_over_fp8(tokens: int) -> None:
    """gate_up after the norm with SiLU x mul, against the torch ops over the dequantized
    weight (a wide weight: FP8 activations at every token count)."""
    n, k = 14336, 4096
    fp8 = quantize_weight(_weight(2 * n, k, seed=2))
    x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=3)
    residual = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=4)
    norm_w = torch.ones(k, dtype=torch.bfloat16, device=DEVICE)
    act, summed = linear_ops.add_norm_linear(x, residual, norm_w, 1e-5, fp8, None, gated=True)
    normed = (x.float() + residual.float()).to(torch.bfloat16)
    torch.testing.assert_close(summed, normed, rtol=0, atol=0)
    rms = normed.float() * torch.rsqrt(normed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    inputs = rms.to(torch.bfloat16)
    codes, scale = quantize_rows(inputs)
    inputs_wide = codes.double() * scale.double()[:, None]
    gate_up = inputs_wide @ dequantize(fp8, torch.float64).t()
    gate, up = gate_up.split(n, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    scale_max = float(ref.abs().max())
    torch.testing.assert_close(act.double(), ref, rtol=2**-6, atol=2**-6 * scale_max)


def test_scaled_mm_path_replays_in_a_cuda_graph() -> None:
    fp8 = quantize_weight(_weight(4096, 4096))
    x = cases.randn((96, 4096), torch.bfloat16, DEVICE, seed=5)
    eager = linear_ops.linear(x, fp8, None)
    graph, (out,) = cases.capture(lambda: (linear_ops.linear(x, fp8, None),))
    x.copy_(cases.randn((96, 4096), torch.bfloat16, DEVICE, seed=6))
    graph.replay()
    torch.testing.assert_close(out, linear_ops.linear(x, fp8, None), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an FP8 tiny Llama, "quant_method": "fp8" per channel, its dequantized reference):
    the layout written by hand, so the lent machine needs no compressed-tensors."""
    root = tmp_path_factory.mktemp("fp8_gpu")
    tiny = make_tiny_llama(root / "bf16", seed=0)
    fp8 = write_fp8_method(tiny, root / "fp8", per_channel=True)
    return fp8, write_dequantized(fp8, root / "dequantized")


def test_fp8_float32_engine_matches_transformers(fp8_dirs: tuple[Path, Path]) -> None:
    """float32 activations: the one-token FP8 GEMV in decode, the dequantized product
    elsewhere; tokens equal transformers' on the dequantized weights."""
    fp8, reference = fp8_dirs
    engine = Engine(model_path=str(fp8), device="cuda", dtype="float32", max_total_tokens=8192)
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40, 1])
    ours = engine_outputs(engine, prompts, 24)
    engine.shutdown()
    for out, ref in zip(ours, hf_greedy(reference, prompts, 24, device="cuda"), strict=True):
        assert_matches_reference(out, ref)


@pytest.mark.parametrize("disable_cuda_graph", [False, True])
def test_fp8_bfloat16_engine_with_and_without_graphs(
    fp8_dirs: tuple[Path, Path], disable_cuda_graph: bool
) -> None:
    """bfloat16 with FP8 activations past a few tokens: transformers' float32 tokens on
    the dequantized weights, up to near-ties (0.5, as the bfloat16 engine test's)."""
    fp8, reference = fp8_dirs
    engine = Engine(
        model_path=str(fp8),
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=8192,
        disable_cuda_graph=disable_cuda_graph,
    )
    assert (engine.runner.graphs is None) == disable_cuda_graph
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40])
    ours = engine_outputs(engine, prompts, 16)
    engine.shutdown()
    for out, ref in zip(ours, hf_greedy(reference, prompts, 16, device="cuda"), strict=True):
        assert_matches_reference(out, ref, tolerance=0.5)
