"""The fused MoE Triton kernels with FP8 experts compiled on CUDA (W8A8 on the FP8 tensor
cores), bfloat16 activations, at real models' shapes (Qwen3-30B-A3B, Mixtral-8x7B, as
test_moe_cuda.py) against a float64 reference over the dequantized experts and the
dequantized rows each launch quantizes (x for gate_up, the activations for down), and
replayed inside a CUDA graph with routings other than the captured one.

The bound (kernels/fp8's projection tests' 2**-6, doubled for the sum over top-k and
the activations' codes, which a gate or up value rounded to the other side of a
bfloat16 tie moves): elementwise rtol 2**-5 with atol 2**-5 of the output's largest.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.fp8 import Fp8Weight, quantize_rows
from radixserve.engine.kernels.moe import fused_moe, select_experts

pytestmark = pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here")

DEVICE = torch.device("cuda")
# name -> (hidden, experts, top_k, expert rows, renormalise)
MODELS = {
    "qwen3_30b_a3b": (2048, 128, 8, 768, True),
    "mixtral_8x7b": (4096, 8, 2, 14336, True),
}
TOKENS = {"qwen3_30b_a3b": [1, 3, 16, 129, 1024], "mixtral_8x7b": [1, 2, 7, 33]}
BOUND = 2**-5


def _stacked_fp8(w: torch.Tensor) -> Fp8Weight:
    """Each expert quantized per row, as --quantization fp8 does (model/quantization.py)."""
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        codes[e], scale[e] = quantize_rows(w[e])
    return Fp8Weight(codes, scale)


def _weights(name: str, seed: int = 0) -> tuple[Fp8Weight, Fp8Weight, torch.Tensor]:
    hidden, experts, _, n, _ = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        return out.normal_(0.0, shape[-1] ** -0.5, generator=gen)

    return (
        _stacked_fp8(draw(experts, 2 * n, hidden)),
        _stacked_fp8(draw(experts, hidden, n)),
        (draw(experts, hidden)),
    )


def _routed(
    name: str, router: torch.Tensor, tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, _, top_k, _, renorm = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(x @ router.t(), top_k, renorm, torch.bfloat16)
    return x, weights, ids


def _wide_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row and dequantized, float64: what a W8A8 launch multiplies."""
    codes, scale = quantize_rows(x)
    return codes.double() * scale.double()[:, None]


def _w8a8_reference(
    x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """float64 [tokens, hidden], expert by expert, rounded to bfloat16 where the kernel
    rounds (gate and up, silu_mul, down, x weight)."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xq = _wide_rows(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate_up = xq[token] @ (w13.data[e].double() * w13.scale[e].double()[:, None]).t()
        act = silu_and_mul_torch(gate_up.to(torch.bfloat16))
        down = _wide_rows(act) @ (w2.data[e].double() * w2.scale[e].double()[:, None]).t()
        down = down.to(torch.bfloat16).float() * weights[token, slot, None].float()
        out.index_add_(0, token, down.to(torch.bfloat16).double())
    return out


def _assert_close(
    got: torch.Tensor,
    x: torch.Tensor,
    w13: Fp8Weight,
    w2: Fp8Weight,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    reference = _w8a8_reference(x, w13, w2, weights, ids)
    largest = float(reference.abs().max())
    torch.testing.assert_close(got.double(), reference, rtol=BOUND, atol=BOUND * largest)


@pytest.mark.parametrize("name", list(MODELS))
def test_fp8_fused_moe_matches_the_reference(name: str) -> None:
    w13, w2, router = _weights(name)
    for tokens in TOKENS[name]:
        x, weights, ids = _routed(name, router, tokens, seed=tokens)
        got = fused_moe(x, w13, w2, weights, ids)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        _assert_close(got, x, w13, w2, weights, ids)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tokens", [1, 8])
def test_fp8_fused_moe_replays_in_a_cuda_graph(name: str, tokens: int) -> None:
    """Captured once (the tokens' quantization with it), replayed over other inputs and
    routings."""
    w13, w2, router = _weights(name)
    x, weights, ids = _routed(name, router, tokens, seed=1)
    static = [x.clone(), weights.clone(), ids.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    for seed in (2, 3):
        x, weights, ids = _routed(name, router, tokens, seed=seed)
        for buffer, value in zip(static, (x, weights, ids), strict=True):
            buffer.copy_(value)
        graph.replay()
        _assert_close(out, x, w13, w2, weights, ids)
