"""RMSNorm, alone and fused with the residual add before it.

The Triton kernel rounds where the reference does (the sum to the input dtype before
the norm reads it, the normalised row to the input dtype, then the product with the
weight); its float32 sum of squares adds in another order than torch's mean, so the
normalised row may round an ulp apart from the reference in a few elements (2 ulps
at most after the weight multiply).
"""

from __future__ import annotations

import torch

from radixserve.engine.kernels import dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., n]; the last dim contiguous, up to 3 dims)."""
    if dispatch.use_triton(x):
        from radixserve.engine.kernels.triton_ops.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [tokens, n] rows; inputs are not modified."""
    if dispatch.use_triton(x):
        from radixserve.engine.kernels.triton_ops.norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32, scale in the input dtype: what transformers does.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual
