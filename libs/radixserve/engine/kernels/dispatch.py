"""Which implementation an op runs on a tensor."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# The dtypes the tensor-core kernels take (the few-token GEMV).
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
# Up to this many tokens the projections run the few-token GEMV (kernels/linear.py), which
# streams a decode step's weights faster than cuBLAS there (measured: lab/notebook/2026-11-26-suite-defaults-sm90-built-few-token.md,
# lab/notebook/2026-11-27-few-token-gemv-32-tokens.md).
GEMV_MAX_ROWS = 32
# Weights at least GEMV_WIDE_RATIO times wider than deep (gate_up, the head; not qkv, o
# or down) keep the GEMV to `gemv_wide_max_rows` tokens: there it still streams them faster
# than cuBLASLt on the H100, while on a device of more bandwidth and the same SMs (the
# H200) cuBLASLt wins at 64 tokens (measured: lab/notebook/2026-12-01-figures-from-code-comments.md).
GEMV_WIDE_MAX_ROWS = 64
GEMV_WIDE_MAX_ROWS_BY_DEVICE = {"H200": 48}
GEMV_WIDE_RATIO = 3


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


@functools.cache
def gemv_wide_max_rows(device: torch.device) -> int:
    """How many tokens the few-token GEMV takes over a wide weight on this device
    (GEMV_WIDE_MAX_ROWS off CUDA: the Triton interpreter's tests run the kernels there)."""
    if device.type != "cuda":
        return GEMV_WIDE_MAX_ROWS
    return wide_max_rows_for(torch.cuda.get_device_name(device))


def wide_max_rows_for(device_name: str) -> int:
    """GEMV_WIDE_MAX_ROWS_BY_DEVICE's entry for the first key in the device's name, else
    GEMV_WIDE_MAX_ROWS."""
    return next(
        (rows for key, rows in GEMV_WIDE_MAX_ROWS_BY_DEVICE.items() if key in device_name),
        GEMV_WIDE_MAX_ROWS,
    )
