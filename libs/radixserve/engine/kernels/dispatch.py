"""Which implementation an op runs on a tensor."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# The dtypes the tensor-core kernels take (the few-token GEMV).
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
# Up to this many tokens the projections run the few-token GEMV (kernels/linear.py): one
# decode step's projections of the 8B shape at 2-16 tokens took 5.39-5.45 ms against
# cuBLAS's 5.71-5.93, at 24-32 tokens 5.59 against 5.80-5.84 (bench/gemv_rows.py, H100;
# decode steps of 24 and 32 requests 2-3% shorter, docs/performance.md).
GEMV_MAX_ROWS = 32
# Weights at least GEMV_WIDE_RATIO times wider than deep (gate_up, the head; not qkv, o
# or down) keep the GEMV to `gemv_wide_max_rows` tokens: GEMV_WIDE_MAX_ROWS, where at 48
# and 64 tokens it streamed gate_up in 85.6-85.8 us against cuBLASLt's 88.6-89.1 and the
# head in 364-369 against 387-392, while o and down ran faster on cuBLASLt
# (bench/gemv_rows.py, H100, 2026-11-28); fewer on the devices named in
# GEMV_WIDE_MAX_ROWS_BY_DEVICE. On the H200 (1.27x the H100's bandwidth, the same SMs)
# cuBLASLt streams them faster at 64 tokens: decode steps of 64 requests 5.87-5.89 ms
# against 6.01-6.02 with the GEMV, 48 requests alike (bench/gemv_chain.py: the GEMV still
# 0.6% ahead at 48; docs/performance.md).
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
