"""Inputs and the reference comparison shared by the fused-kernel tests (the Triton
interpreter on the CPU, compiled kernels on CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.engine.kernels.kv_store import KVWrite
from radixserve.engine.kernels.rotary import Rotation, apply_rotary
from radixserve.engine.model.rope import RotaryTable
from radixserve.model_files.config import ModelConfig

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulp_distance(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Largest distance between same-dtype floats counted in representable steps
    (0: bit for bit equal, up to the sign of zero)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype)
    bits = out.dtype.itemsize * 8

    def ordered(x: torch.Tensor) -> torch.Tensor:
        raw = x.contiguous().view(_INT_VIEW[x.dtype]).long()
        magnitude = raw & ((1 << (bits - 1)) - 1)
        return torch.where(raw < 0, -magnitude, magnitude)

    if out.numel() == 0:
        return 0
    return int((ordered(out) - ordered(ref)).abs().max())


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def qkv_views(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k and v as the model makes them: strided views of
    one fused qkv output (split, then reshaped without a copy)."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn((tokens, q_size + 2 * kv_size), dtype, device, seed)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(tokens, heads, head_dim)
    k = k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    assert q.data_ptr() == qkv.data_ptr()  # a view: no copy
    return q, k, v


def kv_buffers(
    slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K and a V buffer of noise, so that a missing or a stray write shows."""
    shape = (slots, kv_heads, head_dim)
    return randn(shape, dtype, device, seed=11), randn(shape, dtype, device, seed=12)


def rotary_without_store(
    q: torch.Tensor, k: torch.Tensor, rotation: Rotation, write: KVWrite
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """apply_rotary_and_store as if it could not store: the two-launch path (rotary,
    then the backend's set_kv), for models compared with and without the fused store."""
    return (*apply_rotary(q, k, rotation), False)


def rotary_table(
    head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device
) -> RotaryTable:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": head_dim * 4,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "vocab_size": 32,
            "max_position_embeddings": max_positions,
        }
    )
    return RotaryTable(config, max_positions, dtype, device)


def positions(tokens: int, max_positions: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Unordered positions spread over the table (its last row included)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, max_positions, (tokens,), generator=gen)
    pos[-1] = max_positions - 1
    return pos.to(device)


# Largest output error in ulps against the torch reference. RMSNorm's reduction order
# and SiLU's exp may move a float32 intermediate by a few ulps; rounded to 16 bits that
# is an ulp at most, which the product with the weight (or up) can make two.
NORM_ULP = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}
SILU_ULP = {torch.float32: 16, torch.bfloat16: 2, torch.float16: 2}
# Elements allowed to differ at all in 16 bits: a wrong rounding mode differs in half.
MAX_MISMATCH_16BIT = 0.01


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_ulp: int) -> None:
    distance = ulp_distance(out, ref)
    assert distance <= max_ulp, f"{distance} ulps from the reference (at most {max_ulp})"
    if out.dtype != torch.float32:
        mismatch = float((out != ref).float().mean())
        assert mismatch <= MAX_MISMATCH_16BIT, f"{mismatch:.2%} of the elements differ"


def project_f64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) summed in float64, rounded once to x's dtype."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out += bias.double()
    return out.to(x.dtype)


def assert_close_projection(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A projection summed in float32 in some order against the float64 sum: an ulp or
    two of the output dtype relative to the largest output (float32: its own sum's
    error). A wrong input, row or bias is off by orders of magnitude more."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out.dtype]
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * scale)


def capture(
    step: Callable[[], tuple[torch.Tensor, ...]],
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """`step` captured in a CUDA graph (run once before, outside, to compile), and the
    outputs it writes on each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out
