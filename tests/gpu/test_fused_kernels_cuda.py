"""The fused Triton kernels compiled on CUDA at Llama-3.1-8B shapes against their torch
references (which on CUDA run torch's own kernels), inside a CUDA graph, and a q/k-norm
model (Qwen3) on them against Hugging Face.

Without CUDA the module skips before it imports the kernels (see
test_triton_attention_cuda.py: defining them here would fix them as compiled).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.activation import silu_and_mul, silu_and_mul_torch
from radixserve.engine.kernels.kv_store import KVWrite, store_kv, store_kv_torch
from radixserve.engine.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
)
from radixserve.engine.kernels.rotary import (
    Rotation,
    apply_rotary,
    apply_rotary_and_store,
    rotary_torch,
)
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.model_harness import ModelHarness
from tests.helpers.tiny_models import make_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set in this process"),
]

CUDA = torch.device("cuda")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
MAX_POSITIONS = 8192
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 64, 333]
# Llama-3.1-8B's heads, and SmolLM2-135M's (head counts not powers of two).
ROTARY_SHAPES = [(HEADS, KV_HEADS, HEAD_DIM), (9, 3, 64)]
EPS = 1e-5


def norm_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * cases.randn((n,), torch.float32, CUDA, seed=7)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_norms(dtype: torch.dtype, tokens: int) -> None:
    x = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=1)
    residual = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=2)
    weight = norm_weight(HIDDEN, dtype)
    max_ulp = cases.NORM_ULP[dtype]
    cases.assert_matches(rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS), max_ulp)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    ref, ref_residual = fused_add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    cases.assert_matches(out, ref, max_ulp)
    q, _, _ = cases.qkv_views(tokens, HEADS, KV_HEADS, HEAD_DIM, dtype, CUDA)
    head_weight = norm_weight(HEAD_DIM, dtype)
    cases.assert_matches(
        rms_norm(q, head_weight, EPS), rms_norm_torch(q, head_weight, EPS), max_ulp
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROTARY_SHAPES)
def test_rotary_is_exact(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, k, _ = cases.qkv_views(tokens, heads, kv_heads, head_dim, dtype, CUDA)
    table = cases.rotary_table(head_dim, MAX_POSITIONS, dtype, CUDA)
    positions = cases.positions(tokens, MAX_POSITIONS, CUDA)
    q_out, k_out = apply_rotary(q, k, Rotation.of(table, positions))
    q_ref, k_ref = rotary_torch(q, k, *table.lookup(positions))
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(dtype: torch.dtype, tokens: int) -> None:
    gate_up = 2 * cases.randn((tokens, 2 * INTERMEDIATE), dtype, CUDA, seed=4)
    cases.assert_matches(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), cases.SILU_ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_store_kv_is_exact(dtype: torch.dtype, tokens: int) -> None:
    _, k, _ = cases.qkv_views(tokens, HEADS, KV_HEADS, HEAD_DIM, dtype, CUDA)
    v = 2 * k  # a strided view's copy; k itself stays strided
    loc = torch.randperm(4096, device=CUDA)[:tokens] + 1
    ours = [torch.zeros((4097, KV_HEADS, HEAD_DIM), dtype=dtype, device=CUDA) for _ in "kv"]
    ref = [torch.zeros_like(ours[0]) for _ in "kv"]
    store_kv(ours[0], ours[1], loc, k, v)
    store_kv_torch(ref[0], ref[1], loc, k, v)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROTARY_SHAPES)
def test_rotary_store_matches_rotary_then_store_kv(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The rotary kernel storing the KV (one launch) against rotary, then store_kv."""
    q, k, v = cases.qkv_views(tokens, heads, kv_heads, head_dim, dtype, CUDA)
    table = cases.rotary_table(head_dim, MAX_POSITIONS, dtype, CUDA)
    rotation = Rotation.of(table, cases.positions(tokens, MAX_POSITIONS, CUDA))
    loc = torch.randperm(4096, device=CUDA)[:tokens] + 1
    ours = cases.kv_buffers(4097, kv_heads, head_dim, dtype, CUDA)
    ref = (ours[0].clone(), ours[1].clone())
    q_out, k_out, stored = apply_rotary_and_store(q, k, rotation, KVWrite(*ours, loc, v))
    q_ref, k_ref = apply_rotary(q, k, rotation)
    store_kv(ref[0], ref[1], loc, k_ref, v)
    assert stored
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_kernels_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs copied into the static buffers."""
    dtype, tokens = torch.bfloat16, 8
    table = cases.rotary_table(HEAD_DIM, MAX_POSITIONS, dtype, CUDA)
    weight = norm_weight(HIDDEN, dtype)
    x = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=1)
    residual = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=2)
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = cases.randn((tokens, qkv_width), dtype, CUDA, seed=3)
    gate_up = cases.randn((tokens, 2 * INTERMEDIATE), dtype, CUDA, seed=4)
    positions = cases.positions(tokens, MAX_POSITIONS, CUDA)

    def step() -> tuple[torch.Tensor, ...]:
        q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = q.reshape(tokens, HEADS, HEAD_DIM)
        k = k.reshape(tokens, KV_HEADS, HEAD_DIM)
        normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
        q_out, k_out = apply_rotary(q, k, Rotation.of(table, positions))
        return normed, new_residual, q_out, k_out, silu_and_mul(gate_up)

    graph, static_out = cases.capture(step)
    for seed in (10, 20):
        for i, buf in enumerate((x, residual, qkv, gate_up)):
            buf.copy_(cases.randn(tuple(buf.shape), dtype, CUDA, seed=seed + i))
        positions.copy_(cases.positions(tokens, MAX_POSITIONS, CUDA, seed=seed))
        graph.replay()
        expected = step()
        for got, want in zip(static_out, expected, strict=True):
            assert torch.equal(got, want)


def test_rotary_store_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new q/k/v, positions and slots in the static buffers:
    the KV lands at the new slots, as rotary then store_kv put it."""
    dtype, tokens = torch.bfloat16, 8
    table = cases.rotary_table(HEAD_DIM, MAX_POSITIONS, dtype, CUDA)
    qkv = cases.randn((tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype, CUDA, seed=3)
    positions = cases.positions(tokens, MAX_POSITIONS, CUDA)
    loc = torch.arange(1, tokens + 1, device=CUDA)
    buffers = cases.kv_buffers(4097, KV_HEADS, HEAD_DIM, dtype, CUDA)

    def split() -> tuple[torch.Tensor, ...]:
        sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
        q, k, v = qkv.split(sizes, -1)
        return (
            q.view(tokens, HEADS, HEAD_DIM),
            k.view(tokens, -1, HEAD_DIM),
            v.view(tokens, -1, HEAD_DIM),
        )

    def step() -> tuple[torch.Tensor, ...]:
        q, k, v = split()
        rotation = Rotation.of(table, positions)
        q_out, k_out, stored = apply_rotary_and_store(q, k, rotation, KVWrite(*buffers, loc, v))
        assert stored
        return q_out, k_out

    graph, static_out = cases.capture(step)
    for seed in (10, 20):
        qkv.copy_(cases.randn(tuple(qkv.shape), dtype, CUDA, seed=seed))
        positions.copy_(cases.positions(tokens, MAX_POSITIONS, CUDA, seed=seed))
        loc.copy_(torch.randperm(4096, device=CUDA)[:tokens] + 1)
        expected = (buffers[0].clone(), buffers[1].clone())
        graph.replay()
        q, k, v = split()
        q_ref, k_ref = apply_rotary(q, k, Rotation.of(table, positions))
        store_kv(expected[0], expected[1], loc, k_ref, v)
        assert torch.equal(static_out[0], q_ref) and torch.equal(static_out[1], k_ref)
        assert torch.equal(buffers[0], expected[0]) and torch.equal(buffers[1], expected[1])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_gpu"), seed=1))


def test_qk_norm_model_matches_hf(qwen3_dir: Path) -> None:
    harness = ModelHarness(qwen3_dir, device="cuda")
    gen = torch.Generator().manual_seed(0)
    vocab = harness.config.vocab_size
    seqs = [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in (5, 1, 33)]
    rows = [harness.requests.new_request() for _ in seqs]
    logits = harness.run(
        harness.requests.build(ForwardMode.EXTEND, list(zip(rows, seqs, strict=True)))
    )
    expected = torch.stack([harness.reference_logits(ids)[-1] for ids in seqs])
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
