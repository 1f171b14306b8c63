"""Per-token dynamic FP8 quantization of activations (kernels/fp8.py's `quantize_tokens`).

One program per row: a pass for the row's absolute maximum, then a pass that divides
by the scale and casts to float8_e4m3fn (round to nearest even, saturating), the row
read again from L2. The scale is max(absmax / FP8_MAX, MIN_SCALE), as the torch
reference computes it; the division is IEEE in both, so codes match it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_tokens_kernel(
    X,
    Q,
    Scale,
    stride_x,
    K: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    absmax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.max(absmax, axis=0) / FP8_MAX_, MIN_SCALE_)
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        kmask = ks < K
        x = tl.load(x_row + ks, mask=kmask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_, FP8_MAX_)
        tl.store(Q + row * K + ks, q.to(Q.dtype.element_ty), mask=kmask)


def quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] float8_e4m3fn, scales [m, 1] float32) for rows x [m, k] (unit stride
    along k)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_tokens takes rows with unit stride")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(k))
    _quantize_tokens_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        K=k,
        FP8_MAX_=FP8_MAX,
        MIN_SCALE_=MIN_SCALE,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return q, scale
