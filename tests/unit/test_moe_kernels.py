"""The MoE kernels (engine/kernels/moe.py): the fused Triton grouped GEMMs against the
torch reference under the Triton interpreter (token counts from 1, top-k 1 and 2, 4 and
8 experts, odd sizes, 16-bit and float32), moe_align_block_size against a NumPy
reference, and routing against transformers' own routers.

TRITON_INTERPRET is set before anything imports the kernels (as test_fused_kernels.py),
and bfloat16 rounds to nearest even as compiled. Bounds: float32 to summation order;
in bfloat16 each (token, expert) pair's weighted output is the reference's bit for
bit, and only the sum over top-k rounds elsewhere (the reference adds expert by expert
in bfloat16, the kernel path sums in float32 and rounds once).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.moe import fused_moe, fused_moe_torch, select_experts
from radixserve.engine.kernels.moe_align import max_padded_rows, moe_align_block_size
from radixserve.engine.kernels.triton_ops.fused_moe import fused_moe_triton
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device(round_bf16=True)

# (tokens, experts, top_k, hidden, expert intermediate): odd sizes cross the tiles' edges.
SHAPES = [
    (1, 4, 1, 64, 32),
    (1, 8, 2, 48, 40),
    (3, 8, 2, 33, 17),
    (7, 4, 2, 64, 48),
    (20, 8, 2, 40, 24),  # more tokens than experts: the larger tiles
    (13, 4, 1, 24, 72),
]


def _case(
    tokens: int, experts: int, top_k: int, hidden: int, n: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)

    x = draw(tokens, hidden)
    w13 = draw(experts, 2 * n, hidden, scale=hidden**-0.5)
    w2 = draw(experts, hidden, n, scale=n**-0.5)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, ids = select_experts(logits, top_k, top_k > 1, dtype)
    return x, w13, w2, weights, ids


def _pair_by_pair(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """[tokens, top_k, hidden]: each (token, slot)'s weighted expert output, rounded as
    the reference rounds it before the sum."""
    rows = []
    for t in range(ids.shape[0]):
        slots = []
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            act = silu_and_mul_torch(x[t : t + 1] @ w13[e].t())
            slots.append(((act @ w2[e].t()) * weights[t, k]).to(x.dtype)[0])
        rows.append(torch.stack(slots))
    return torch.stack(rows)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_fused_moe_matches_the_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _case(*shape, dtype=dtype, seed=sum(shape))
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    reference = fused_moe_torch(x, w13, w2, weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference, atol=2e-6, rtol=2e-6)
        return
    # Each pair's output is the reference's bit for bit; only the sum over top-k is
    # rounded elsewhere (float32 then once, vs expert by expert in bfloat16).
    pairs = _pair_by_pair(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, pairs.float().sum(1).to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(got.float(), reference.float(), atol=2e-2, rtol=1e-2)


def test_an_expert_taking_every_token_and_others_none() -> None:
    """All tokens on one expert (runs longer than a block; empty experts) and the
    dispatching entry point on the CPU (the reference)."""
    x, w13, w2, _, _ = _case(21, 8, 2, 32, 16, torch.float32, seed=3)
    ids = torch.tensor([[5, 2]] * 21, device=DEVICE)
    weights = torch.full((21, 2), 0.5, device=DEVICE)
    want = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids), want)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), want, atol=0, rtol=0)
    expected = 0.5 * (
        silu_and_mul_torch(x @ w13[5].t()) @ w2[5].t()
        + silu_and_mul_torch(x @ w13[2].t()) @ w2[2].t()
    )
    torch.testing.assert_close(want, expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_refuses_mismatched_shapes() -> None:
    x, w13, w2, weights, ids = _case(3, 4, 2, 32, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def _align_numpy(topk_ids: np.ndarray, experts: int, block: int) -> tuple[list[int], list[int]]:
    """(sorted pair ids of the used rows, padding as -1; each used block's expert)."""
    flat = topk_ids.reshape(-1)
    rows: list[int] = []
    blocks: list[int] = []
    for e in range(experts):
        pairs = [i for i, v in enumerate(flat) if v == e]
        padded = -(-len(pairs) // block) * block
        rows += pairs + [-1] * (padded - len(pairs))
        blocks += [e] * (padded // block)
    return rows, blocks


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block"),
    [(1, 4, 1, 16), (1, 128, 8, 16), (5, 4, 2, 4), (37, 8, 2, 16), (64, 8, 2, 64), (9, 3, 3, 2)],
)
def test_moe_align_block_size_matches_numpy(
    tokens: int, experts: int, top_k: int, block: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(
        DEVICE
    )
    routes = moe_align_block_size(ids, experts, block)
    pairs = ids.numel()
    want_rows, want_blocks = _align_numpy(ids.cpu().numpy(), experts, block)
    used = int(routes.num_padded.item())
    assert used == len(want_rows)
    assert routes.sorted_ids.numel() == max_padded_rows(pairs, experts, block) >= used
    got = routes.sorted_ids.cpu().tolist()
    assert [-1 if r == pairs else r for r in got[:used]] == want_rows
    assert all(r == pairs for r in got[used:])  # the unused rows are padding
    assert routes.block_experts.cpu().tolist()[: used // block] == want_blocks


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("norm", [False, True])
def test_select_experts_matches_transformers_routers(family: str, norm: bool) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = type(
        "Config",
        (),
        {
            "num_experts_per_tok": 3,
            "num_local_experts": 8,
            "num_experts": 8,
            "hidden_size": 16,
            "norm_topk_prob": norm,
        },
    )()
    router_class = {
        "mixtral": MixtralTopKRouter,
        "qwen2_moe": Qwen2MoeTopKRouter,
        "qwen3_moe": Qwen3MoeTopKRouter,
    }[family]
    router = router_class(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        hidden = torch.randn(10, 16, generator=gen).to(torch.bfloat16)
        router = router.to(torch.bfloat16)
        logits, want_weights, want_ids = router(hidden)
    mixtral = family == "mixtral"
    weight_dtype = torch.float32 if mixtral else torch.bfloat16
    weights, ids = select_experts(logits, 3, mixtral or norm, weight_dtype)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=0)
