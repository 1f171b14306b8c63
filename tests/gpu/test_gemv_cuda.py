"""The one-token projections (engine/kernels/linear.py: Triton GEMVs with the norm or
activation folded in, launched as programmatic dependents on Hopper) compiled on CUDA at
the Llama-3.1-8B shapes, against the unfused path summed in float64; and a decoder
chain of them captured in a CUDA graph, replayed on new inputs, against eager runs (a
missing wait between dependent launches would show as a race here).

Without CUDA the module skips before it imports the kernels (see
test_triton_attention_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.linear import add_norm_linear, linear
from radixserve.engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from tests.helpers import fused_kernel_cases as cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set in this process"),
]

CUDA = torch.device("cuda")
HIDDEN, QKV, INTERMEDIATE, VOCAB = 4096, 6144, 14336, 128256
EPS = 1e-5
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (cases.randn((n, k), torch.float32, CUDA, seed) * k**-0.5).to(dtype)


def _norm_weight(dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * cases.randn((HIDDEN,), torch.float32, CUDA, seed=7)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 16, 32, 48, 64])
def test_projections_match_the_unfused_path(dtype: torch.dtype, tokens: int) -> None:
    """One token: the fused GEMVs; 2-32 (16-bit): the norm or activation kernel, then
    the few-token GEMV; 48 and 64: cuBLAS for these (not wide) weights (the few-token
    GEMV for gate_up); float32 beyond one token: cuBLAS."""
    x = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=1)
    residual = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=2)
    norm_w = _norm_weight(dtype)
    qkv_w, o_w = _weight(QKV, HIDDEN, dtype, 3), _weight(HIDDEN, HIDDEN, dtype, 4)
    down_w = _weight(HIDDEN, INTERMEDIATE, dtype, 5)
    bias = cases.randn((QKV,), dtype, CUDA, seed=6)

    out, summed = add_norm_linear(x, residual, norm_w, EPS, qkv_w, bias)
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    assert torch.equal(summed, ref_sum)
    cases.assert_close_projection(out, cases.project_f64(normed, qkv_w, bias))

    out, same = add_norm_linear(x, None, norm_w, EPS, qkv_w, None)
    assert same is x
    ref = cases.project_f64(rms_norm_torch(x, norm_w, EPS), qkv_w, None)
    cases.assert_close_projection(out, ref)

    cases.assert_close_projection(linear(x, o_w, None), cases.project_f64(x, o_w, None))

    gate_up_w = _weight(2 * INTERMEDIATE, HIDDEN, dtype, 8)
    act, summed = add_norm_linear(x, residual, norm_w, EPS, gate_up_w, None, gated=True)
    assert torch.equal(summed, ref_sum)
    ref = silu_and_mul_torch(cases.project_f64(normed, gate_up_w, None))
    cases.assert_close_projection(act, ref)
    act = 2 * cases.randn((tokens, INTERMEDIATE), dtype, CUDA, seed=9)
    cases.assert_close_projection(linear(act, down_w, None), cases.project_f64(act, down_w, None))


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_head_writes_the_logits_buffer(tokens: int) -> None:
    """The head with its final norm, with and without the residual add (the model's
    forward adds the last residual there), into the runner's logits buffer."""
    dtype = torch.bfloat16
    x = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=1)
    residual = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=2)
    norm_w, head = _norm_weight(dtype), _weight(VOCAB, HIDDEN, dtype, 9)
    logits = torch.empty((tokens, VOCAB), dtype=dtype, device=CUDA)
    out, _ = add_norm_linear(x, None, norm_w, EPS, head, None, out=logits)
    assert out is logits
    cases.assert_close_projection(
        logits, cases.project_f64(rms_norm_torch(x, norm_w, EPS), head, None)
    )
    out, summed = add_norm_linear(x, residual, norm_w, EPS, head, None, out=logits)
    normed, ref_sum = fused_add_rms_norm_torch(x, residual, norm_w, EPS)
    assert out is logits and torch.equal(summed, ref_sum)
    cases.assert_close_projection(logits, cases.project_f64(normed, head, None))


@pytest.mark.parametrize("tokens", [1, 8, 16, 32, 64])
def test_decoder_chain_replays_in_a_cuda_graph(tokens: int) -> None:
    """Two layers of qkv (add + norm), o, gate_up (add + norm, SiLU x mul), down, each
    kernel dependent on the one before (one token: the fused GEMVs; 8 to 32: the norm and
    activation kernels and the few-token GEMV, all launched as programmatic dependents
    on Hopper, the GEMVs releasing the next launch early up to 16): replays on new
    inputs equal eager runs
    bit for bit, and the unfused path within rounding."""
    dtype = torch.bfloat16
    layers = [
        (
            _weight(QKV, HIDDEN, dtype, 10 * i + 1),
            _weight(HIDDEN, HIDDEN, dtype, 10 * i + 2),
            _weight(2 * INTERMEDIATE, HIDDEN, dtype, 10 * i + 3),
            _weight(HIDDEN, INTERMEDIATE, dtype, 10 * i + 4),
        )
        for i in range(2)
    ]
    norm_w = _norm_weight(dtype)
    x = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=1)
    residual = cases.randn((tokens, HIDDEN), dtype, CUDA, seed=2)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        hidden, res = x, residual
        for qkv_w, o_w, gate_up_w, down_w in layers:
            qkv, res = add_norm_linear(hidden, res, norm_w, EPS, qkv_w, None)
            attn_out = linear(qkv[:, :HIDDEN], o_w, None)
            act, res = add_norm_linear(attn_out, res, norm_w, EPS, gate_up_w, None, gated=True)
            hidden = linear(act, down_w, None)
        return hidden, res

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        hidden, res = x, residual
        for qkv_w, o_w, gate_up_w, down_w in layers:
            normed, res = fused_add_rms_norm_torch(hidden, res, norm_w, EPS)
            qkv = cases.project_f64(normed, qkv_w, None)
            attn_out = cases.project_f64(qkv[:, :HIDDEN], o_w, None)
            normed, res = fused_add_rms_norm_torch(attn_out, res, norm_w, EPS)
            gate_up = cases.project_f64(normed, gate_up_w, None)
            hidden = cases.project_f64(silu_and_mul_torch(gate_up), down_w, None)
        return hidden, res

    graph, static_out = cases.capture(step)
    for seed in (10, 20):
        x.copy_(cases.randn((tokens, HIDDEN), dtype, CUDA, seed=seed))
        residual.copy_(cases.randn((tokens, HIDDEN), dtype, CUDA, seed=seed + 1))
        graph.replay()
        eager = step()
        for got, want in zip(static_out, eager, strict=True):
            assert torch.equal(got, want)
        # Two layers of bf16 rounding apart from the float64 sums: a few ulps.
        ref_hidden, _ = unfused()
        scale = float(ref_hidden.float().abs().max())
        torch.testing.assert_close(
            static_out[0].float(), ref_hidden.float(), rtol=2**-5, atol=2**-5 * scale
        )
