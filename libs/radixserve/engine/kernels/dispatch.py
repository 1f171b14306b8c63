"""Which implementation an op runs on a tensor."""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors; the torch reference elsewhere or without triton.

    The kernel modules (kernels/triton_ops) are imported on the first CUDA call only:
    importing them imports triton, which CPU installs may lack, and defines the kernels,
    compiled or interpreted as TRITON_INTERPRET stands then.
    """
    return x.is_cuda and HAS_TRITON
