"""The fused MoE Triton kernels compiled on CUDA, bfloat16, at real models' shapes
(Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert rows 768; Mixtral-8x7B: hidden
4096, 8 experts, top-2, expert rows 14336) against the torch reference, and replayed
inside a CUDA graph with routings other than the captured one.

The bound: both bfloat16 paths against a float32 reference over the same weights; the
kernel's error may be at most a little over the reference's own (other summation
orders, one rounding of the top-k sum instead of one per expert).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels.moe import fused_moe, fused_moe_torch, select_experts

pytestmark = pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here")

DEVICE = torch.device("cuda")
# name -> (hidden, experts, top_k, expert rows, renormalise)
MODELS = {
    "qwen3_30b_a3b": (2048, 128, 8, 768, True),
    "mixtral_8x7b": (4096, 8, 2, 14336, True),
}
TOKENS = {"qwen3_30b_a3b": [1, 3, 16, 129, 1024], "mixtral_8x7b": [1, 2, 7, 33]}


def _weights(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, experts, _, n, _ = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        return out.normal_(0.0, shape[-1] ** -0.5, generator=gen)

    return draw(experts, 2 * n, hidden), draw(experts, hidden, n), draw(experts, hidden)


def _routed(
    name: str, router: torch.Tensor, tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, _, top_k, _, renorm = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(x @ router.t(), top_k, renorm, torch.bfloat16)
    return x, weights, ids


def _assert_close_to_float32(
    got: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    exact = fused_moe_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    reference = fused_moe_torch(x, w13, w2, weights, ids)
    ref_err = (reference.float() - exact).abs().max().item()
    err = (got.float() - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert err <= 1.5 * ref_err + 1e-3 * scale, (err, ref_err, scale)


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_moe_matches_the_reference(name: str) -> None:
    w13, w2, router = _weights(name)
    for tokens in TOKENS[name]:
        x, weights, ids = _routed(name, router, tokens, seed=tokens)
        got = fused_moe(x, w13, w2, weights, ids)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        _assert_close_to_float32(got, x, w13, w2, weights, ids)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tokens", [1, 8])
def test_fused_moe_replays_in_a_cuda_graph(name: str, tokens: int) -> None:
    """Captured once, replayed over other inputs and routings: the padded buffers and
    the device-side row count serve any routing."""
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
        _assert_close_to_float32(out, x, w13, w2, weights, ids)
    # Every pair on one expert: the longest run the padding allows.
    ids = torch.full_like(static[2], 0)
    ids[:, 1:] = torch.arange(1, ids.shape[1], device=DEVICE)
    static[2].copy_(ids)
    graph.replay()
    _assert_close_to_float32(out, static[0], w13, w2, static[1], static[2])
