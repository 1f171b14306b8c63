"""Block-wise FP8 compiled on CUDA (Hopper): the per-token-group quantization kernel
against its torch reference, the projections of kernels/linear.py over a block weight
(quantized tokens, the block-scaled W8A8 GEMM) at every token count against the float64
product, a CUDA-graph replay, and the engine's greedy tokens on a tiny block-FP8 Llama
(both layouts) against transformers' on the dequantized weights."""

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
from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize, quantize_token_groups
from radixserve.engine.kernels.triton_ops.fp8_block import quantize_token_groups_triton
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)
from tests.unit.fp8_block_checkpoints import (
    BLOCK,
    BLOCK_SHAPE,
    LAYOUTS,
    quantize_blocks,
    write_block_fp8,
    write_dequantized,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here"),
]

DEVICE = torch.device("cuda")
# DeepSeek-V3-like and Qwen3-8B-like projections (n, k), and one of partial blocks.
SHAPES = [(4096, 7168), (24576, 4096), (4096, 12288), (200, 320)]
TOKENS = [1, 5, 33, 64, 300]


def _block_weight(n: int, k: int, seed: int = 0) -> Fp8Weight:
    wide = cases.randn((n, k), torch.float32, DEVICE, seed) * k**-0.5
    wide *= torch.logspace(-1, 1, n, device=DEVICE)[:, None]  # blocks of unlike scales
    return quantize_blocks(wide, BLOCK)


def _reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The float64 product of the tokens quantized per group by the torch reference."""
    codes, scale = quantize_token_groups(x.cpu(), BLOCK[1])
    k = x.shape[1]
    tokens = codes.double() * scale.double().repeat_interleave(BLOCK[1], 1)[:, :k]
    return (tokens.to(DEVICE) @ dequantize(weight, torch.float64).t()).to(x.dtype)


def test_group_quantization_kernel_matches_the_reference() -> None:
    x = cases.randn((37, 7168), torch.bfloat16, DEVICE, seed=1)
    x[3] = 0.0
    x[5, :128] *= 1000.0  # one group far larger than its row's others
    codes, scale = quantize_token_groups_triton(x, BLOCK[1])
    ref_codes, ref_scale = quantize_token_groups(x.cpu(), BLOCK[1])
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=1e-6, atol=0)
    # Compiled, the cast rounds to nearest even as torch's: one code apart at most, rarely.
    torch.testing.assert_close(codes.float().cpu(), ref_codes.float(), rtol=2**-3, atol=2**-9)
    assert (codes.cpu().view(torch.uint8) != ref_codes.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_projections_match_the_dequantized_product(n: int, k: int) -> None:
    weight = _block_weight(n, k)
    bias = cases.randn((n,), torch.bfloat16, DEVICE, seed=9)
    for tokens in TOKENS:
        x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=tokens)
        got = linear_ops.linear(x, weight, None)
        assert got.shape == (tokens, n) and got.dtype == torch.bfloat16
        cases.assert_close_projection(got, _reference(x, weight))
    with_bias = linear_ops.linear(x, weight, bias)
    cases.assert_close_projection(with_bias, (_reference(x, weight).double() + bias).to(x.dtype))


@pytest.mark.parametrize("tokens", [1, 64])
def test_add_norm_gated_over_blocks(tokens: int) -> None:
    n, k = 1536, 4096
    weight = _block_weight(2 * n, k, seed=2)
    x = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=3)
    residual = cases.randn((tokens, k), torch.bfloat16, DEVICE, seed=4)
    norm_w = torch.ones(k, dtype=torch.bfloat16, device=DEVICE)
    act, summed = linear_ops.add_norm_linear(x, residual, norm_w, 1e-5, weight, None, gated=True)
    normed = (x.float() + residual.float()).to(torch.bfloat16)
    torch.testing.assert_close(summed, normed, rtol=0, atol=0)
    rms = normed.float() * torch.rsqrt(normed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = _reference(rms.to(torch.bfloat16), weight).double().split(n, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    scale_max = float(ref.abs().max())
    torch.testing.assert_close(act.double(), ref, rtol=2**-6, atol=2**-6 * scale_max)


def test_block_projection_replays_in_a_cuda_graph() -> None:
    weight = _block_weight(4096, 4096)
    x = cases.randn((8, 4096), torch.bfloat16, DEVICE, seed=5)
    eager = linear_ops.linear(x, weight, None)
    graph, (out,) = cases.capture(lambda: (linear_ops.linear(x, weight, None),))
    x.copy_(cases.randn((8, 4096), torch.bfloat16, DEVICE, seed=6))
    graph.replay()
    torch.testing.assert_close(out, linear_ops.linear(x, weight, None), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each layout's tiny block-FP8 Llama with its dequantized reference (written by
    hand: the lent machine needs no compressed-tensors)."""
    root = tmp_path_factory.mktemp("fp8_block_gpu")
    tiny = make_tiny_llama(root / "f32", seed=0, **BLOCK_SHAPE)
    dirs = {}
    for layout in LAYOUTS:
        folder = write_block_fp8(tiny, root / layout, layout)
        dirs[layout] = (folder, write_dequantized(folder, root / f"{layout}-dequantized"))
    return dirs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("disable_cuda_graph", [False, True])
def test_block_fp8_engine_matches_transformers(
    block_dirs: dict[str, tuple[Path, Path]], layout: str, disable_cuda_graph: bool
) -> None:
    """bfloat16 with FP8 tokens per group: transformers' float32 tokens on the
    dequantized weights, up to near-ties (0.5, as the per-channel FP8 test's)."""
    folder, reference = block_dirs[layout]
    engine = Engine(
        model_path=str(folder),
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=8192,
        disable_cuda_graph=disable_cuda_graph,
    )
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40])
    ours = engine_outputs(engine, prompts, 16)
    engine.shutdown()
    for out, ref in zip(ours, hf_greedy(reference, prompts, 16, device="cuda"), strict=True):
        assert_matches_reference(out, ref, tolerance=0.5)
