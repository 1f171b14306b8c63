"""Which implementation an op runs on a tensor."""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# The dtypes the tensor-core kernels take (the few-token GEMV).
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


def use_triton(x: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors; the torch reference elsewhere or without triton.

    The kernel modules (kernels/triton_ops) are imported on the first CUDA call only:
    importing them imports triton, which CPU installs may lack, and defines the kernels,
    compiled or interpreted as TRITON_INTERPRET stands then.
    """
    return x.is_cuda and HAS_TRITON and not interpreting()


def interpreting() -> bool:
    """TRITON_INTERPRET is set (CPU tests set it to run the kernels in the interpreter,
    which cannot read CUDA tensors): CUDA tensors then take the torch reference."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
