"""RMSNorm kernels: one program per row, the whole row in one block. Over a few tokens on
Hopper they are launched as programmatic dependents, as the GEMVs around them are
(common.few_token_dependent): a kernel's launch overlaps the end of the one before,
where a decode step of a few tokens is ~10 short kernels a layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import few_token_dependent, start_as_dependent


@triton.jit
def weighted_norm(x, rstd, weight, dtype: tl.constexpr):
    """weight * x * rstd (float32 x and weight) rounded where the reference rounds: the
    normalised values to `dtype`, then the product; returned in `dtype`."""
    return (weight * (x * rstd).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(
    X,
    stride_xa,
    stride_xb,
    Residual,
    stride_r,
    Weight,
    Out,
    ResidualOut,
    eps,
    N: tl.constexpr,
    ROWS_B: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row pid of x seen as [A, ROWS_B, N] (strided, last dim contiguous) into row pid
    of the contiguous Out; with HAS_RESIDUAL (2-D x, ROWS_B == 1) the row is first
    x + residual, rounded and stored to ResidualOut."""
    start_as_dependent(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x_row = X + (row // ROWS_B) * stride_xa + (row % ROWS_B) * stride_xb
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x + r
        # The norm reads the sum as stored, rounded to the input dtype.
        summed = x.to(ResidualOut.dtype.element_ty)
        tl.store(ResidualOut + row * N + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * N + offs, weighted_norm(x, rstd, w, X.dtype.element_ty), mask=mask)


def _launch(
    x3: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    a, b, n = x3.shape
    if x3.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(f"rms_norm needs a contiguous last dim and a [{n}] weight")
    block = triton.next_power_of_2(n)
    pdl = few_token_dependent(x3.device, a * b)
    _rms_norm_kernel[(a * b,)](
        x3,
        x3.stride(0),
        x3.stride(1),
        x3 if residual is None else residual,
        n if residual is None else residual.stride(0),
        weight,
        out,
        out if residual_out is None else residual_out,
        eps,
        N=n,
        ROWS_B=b,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=min(max(block // 512, 1), 16),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not 1 <= x.dim() <= 3:
        raise ValueError(f"rms_norm takes 1 to 3 dims, got shape {tuple(x.shape)}")
    x3 = x.reshape(1, 1, -1) if x.dim() == 1 else x.unsqueeze(1) if x.dim() == 2 else x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x3, None, weight, eps, out, None)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(
            f"fused_add_rms_norm takes equal [tokens, n] rows, got {tuple(x.shape)} "
            f"and {tuple(residual.shape)}"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x.unsqueeze(1), residual, weight, eps, out, residual_out)
    return out, residual_out
