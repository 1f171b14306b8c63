"""The fused Triton kernels (engine/kernels) against their torch references, under the
Triton interpreter on the CPU: small odd shapes, strided q/k views, 1 to a few tokens.

As in test_triton_attention.py, TRITON_INTERPRET is set before anything imports the
kernels (Triton picks the interpreter when a kernel is defined); the interpreter is
also made to round float32 -> bfloat16 to nearest even, as compiled kernels do, so
16-bit results compare bit for bit. Bounds: rotary is exact; RMSNorm (its reduction
order) and SiLU (NumPy's exp) may differ by an ulp at an intermediate rounding, so
by up to 2 ulps in a few elements of the output.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.kv_store import KVWrite, store_kv_torch
from radixserve.engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from radixserve.engine.kernels.rotary import (
    Rotation,
    apply_rotary,
    apply_rotary_and_store,
    rotary_torch,
)
from radixserve.engine.kernels.triton_ops.activation import silu_and_mul_triton
from radixserve.engine.kernels.triton_ops.kv_store import store_kv_triton
from radixserve.engine.kernels.triton_ops.norm import fused_add_rms_norm_triton, rms_norm_triton
from radixserve.engine.kernels.triton_ops.rotary import rotary_triton
from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.model import llama
from tests.helpers import fused_kernel_cases as cases
from tests.helpers.model_harness import ModelHarness
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device(round_bf16=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def norm_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * cases.randn((n,), torch.float32, DEVICE, seed=7)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (5, 576), (3, 64)])
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = cases.randn((tokens, hidden), dtype, DEVICE, seed=1)
    weight = norm_weight(hidden, dtype)
    before = x.clone()
    out = rms_norm_triton(x, weight, EPS)
    cases.assert_matches(out, rms_norm_torch(x, weight, EPS), max_ulp=cases.NORM_ULP[dtype])
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: over head_dim of views into the fused qkv output."""
    q, k, _ = cases.qkv_views(4, 3, 1, 64, dtype, DEVICE)
    weight = norm_weight(64, dtype)
    for x in (q, k):
        out = rms_norm_triton(x, weight, EPS)
        assert out.is_contiguous()
        cases.assert_matches(out, rms_norm_torch(x, weight, EPS), max_ulp=cases.NORM_ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_add_rms_norm(dtype: torch.dtype, tokens: int) -> None:
    x = cases.randn((tokens, 576), dtype, DEVICE, seed=2)
    residual = cases.randn((tokens, 576), dtype, DEVICE, seed=3)
    weight = norm_weight(576, dtype)
    inputs = (x.clone(), residual.clone())
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, EPS)
    ref, ref_residual = fused_add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    cases.assert_matches(out, ref, max_ulp=cases.NORM_ULP[dtype])
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(3, 1, 64), (4, 2, 16), (9, 3, 16)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_rotary_is_exact(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, contiguous: bool
) -> None:
    q, k, _ = cases.qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEVICE)
    if contiguous:  # as after Qwen3's q/k norm
        q, k = q.contiguous(), k.contiguous()
    table = cases.rotary_table(head_dim, 100, dtype, DEVICE)
    positions = cases.positions(tokens, 100, DEVICE)
    inputs = (q.clone(), k.clone())
    q_out, k_out = rotary_triton(q, k, positions, table.cos, table.sin)
    q_ref, k_ref = rotary_torch(q, k, *table.lookup(positions))
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q, inputs[0]) and torch.equal(k, inputs[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (3, 24)])
def test_store_kv_is_exact(dtype: torch.dtype, tokens: int, kv_heads: int, head_dim: int) -> None:
    """K (contiguous, as rotary returns it) and V (a strided slice of qkv) land in the
    buffers at their slots, cast to the buffers' dtype; other slots are untouched."""
    width = (2 + 2 * kv_heads) * head_dim  # two query heads, then k and v
    qkv = cases.randn((tokens, width), dtype, DEVICE, seed=9)
    k = qkv[:, 2 * head_dim : (2 + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    v = qkv[:, (2 + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    k = k.contiguous()
    loc = torch.randperm(20, device=DEVICE)[:tokens] + 1
    for buffer_dtype in {dtype, torch.float32}:
        ours = [torch.zeros((21, kv_heads, head_dim), dtype=buffer_dtype, device=DEVICE)]
        ours.append(torch.zeros_like(ours[0]))
        ref = [torch.zeros_like(ours[0]), torch.zeros_like(ours[0])]
        store_kv_triton(ours[0], ours[1], loc, k, v)
        store_kv_torch(ref[0], ref[1], loc, k, v)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        assert ours[0].count_nonzero() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(3, 1, 64), (4, 2, 24), (9, 3, 16)])
def test_rotary_store_matches_rotary_then_store_kv(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """One launch (rotary with the store) against two (rotary, then store_kv): the same
    q and k, and the same buffers: the rotated k and v (a strided slice of qkv) at
    scattered slots, cast to the buffers' dtype, every other slot untouched."""
    q, k, v = cases.qkv_views(tokens, heads, kv_heads, head_dim, dtype, DEVICE)
    table = cases.rotary_table(head_dim, 100, dtype, DEVICE)
    positions = cases.positions(tokens, 100, DEVICE)
    loc = torch.randperm(20, device=DEVICE)[:tokens] + 1
    q_ref, k_ref = rotary_triton(q, k, positions, table.cos, table.sin)
    for buffer_dtype in {dtype, torch.float32}:
        ours = cases.kv_buffers(21, kv_heads, head_dim, buffer_dtype, DEVICE)
        ref = (ours[0].clone(), ours[1].clone())
        write = KVWrite(ours[0], ours[1], loc, v)
        q_out, k_out = rotary_triton(q, k, positions, table.cos, table.sin, write)
        store_kv_triton(ref[0], ref[1], loc, k_ref, v)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    noise = cases.kv_buffers(21, kv_heads, head_dim, dtype, DEVICE)
    assert not torch.equal(ours[0], noise[0]) and not torch.equal(ours[1], noise[1])


@pytest.mark.parametrize("triton", [False, True])
def test_rotary_store_falls_back_where_the_kernel_cannot_store(
    triton: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the Triton path, or with a v whose head_dim is strided (only on the Triton
    path: the model's v never is), the rotary stores nothing and says so."""
    monkeypatch.setattr(dispatch, "use_triton", lambda x: triton)
    q, k, v = cases.qkv_views(3, 4, 2, 16, torch.float32, DEVICE)
    if triton:
        v = torch.stack([v, v], dim=-1)[..., 0]
        assert v.stride(-1) == 2
    table = cases.rotary_table(16, 100, torch.float32, DEVICE)
    rotation = Rotation.of(table, cases.positions(3, 100, DEVICE))
    assert (rotation.cos_sin is None) == triton
    buffers = cases.kv_buffers(8, 2, 16, torch.float32, DEVICE)
    before = (buffers[0].clone(), buffers[1].clone())
    write = KVWrite(buffers[0], buffers[1], torch.tensor([5, 1, 3], device=DEVICE), v)
    q_out, k_out, stored = apply_rotary_and_store(q, k, rotation, write)
    q_ref, k_ref = apply_rotary(q, k, rotation)
    assert not stored
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(buffers[0], before[0]) and torch.equal(buffers[1], before[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "n"), [(1, 1536), (5, 1536), (3, 40)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, n: int) -> None:
    gate_up = 2 * cases.randn((tokens, 2 * n), dtype, DEVICE, seed=4)
    out = silu_and_mul_triton(gate_up)
    cases.assert_matches(out, silu_and_mul_torch(gate_up), max_ulp=cases.SILU_ULP[dtype])


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_model_on_the_kernels_matches_hf(
    model_dir: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model with every fused op on its kernel (the CUDA path, interpreted):
    the residual stream, the final add + norm on the last tokens, q/k norm, rotary."""
    harness = ModelHarness(Path(request.getfixturevalue(model_dir)), device=str(DEVICE))
    gen = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(100, harness.config.vocab_size, (n,), generator=gen).tolist()
        for n in (5, 1, 9)
    ]
    rows = [harness.requests.new_request() for _ in seqs]
    batch = harness.requests.build(ForwardMode.EXTEND, list(zip(rows, seqs, strict=True)))
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    logits = harness.run(batch)
    expected = torch.stack([harness.reference_logits(ids)[-1] for ids in seqs])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_model_storing_kv_in_the_rotary_kernel_is_exact(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model on the kernels (the CUDA path, interpreted) with the triton backend, in
    float16 (test_triton_attention.py runs the engine in float32): the rotary kernel
    storing each layer's K/V gives the same logits and the same KV pool, bit for bit,
    as rotary then the backend's set_kv, over a prefill and a decode."""
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    stores: list[int] = []
    set_kv = KVPool.set_kv
    monkeypatch.setattr(KVPool, "set_kv", lambda *args: stores.append(1) or set_kv(*args))

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        harness = ModelHarness(
            tiny_llama_dir,
            device=str(DEVICE),
            dtype=torch.float16,
            backend=TritonAttentionBackend(DEVICE),
        )
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(100, 1000, (n,), generator=gen).tolist() for n in (5, 1, 9)]
        rows = [harness.requests.new_request() for _ in seqs]
        build = harness.requests.build
        logits = [harness.run(build(ForwardMode.EXTEND, list(zip(rows, seqs, strict=True))))]
        decode = build(ForwardMode.DECODE, [(row, [7 + row]) for row in rows])
        logits.append(harness.run(decode))
        pool = harness.requests.kv_pool
        return logits, pool.k_buffers + pool.v_buffers

    fused = run()
    assert not stores
    monkeypatch.setattr(llama, "apply_rotary_and_store", cases.rotary_without_store)
    unfused = run()
    num_layers = len(unfused[1]) // 2
    assert len(stores) == 2 * num_layers  # every layer of both passes
    for got, want in zip([*fused[0], *fused[1]], [*unfused[0], *unfused[1]], strict=True):
        assert torch.equal(got, want)
