"""SiLU x mul kernel: one program per (token, block of the intermediate dim), over a few
tokens launched as a programmatic dependent on Hopper (as kernels/triton_ops/norm.py says)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from radixserve.engine.attention.triton_ops.common import (
    INTERPRETED,
    few_token_dependent,
    start_as_dependent,
)

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """silu(gate) * up from float32 gate and up, rounded as torch rounds (SiLU to `dtype`,
    then the product); returned in `dtype`."""
    # torch's SiLU: x / (1 + exp(-x)) in float32 with an IEEE division. Compiled, exp is
    # libdevice's (the CUDA expf torch calls; tl.exp is a faster approximation); the
    # interpreter has no libdevice and uses NumPy's exp.
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    GateUp,
    stride_t,
    Out,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = GateUp + token * stride_t
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    product = silu_mul(gate, up, Out.dtype.element_ty, LIBDEVICE_EXP)
    tl.store(Out + token * N + offs, product, mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul takes [tokens, 2 * n] rows, got {tuple(gate_up.shape)}")
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    pdl = few_token_dependent(gate_up.device, tokens)
    _silu_and_mul_kernel[(tokens, triton.cdiv(n, _BLOCK))](
        gate_up,
        gate_up.stride(0),
        out,
        N=n,
        BLOCK=_BLOCK,
        LIBDEVICE_EXP=not INTERPRETED,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=4,
    )
    return out
