"""The Triton interpreter in CPU tests: skip where kernels were compiled without a GPU,
and round float32 -> bfloat16 as compiled kernels do.

Compiled, `x.to(tl.bfloat16)` rounds to nearest even (cvt.rn.bf16.f32); the
interpreter (Triton <= 3.6) truncates the mantissa instead, so a kernel that
rounds where torch rounds would differ from torch by one unit in the last place
on the CPU only. Tests that compare bf16 kernels bit for bit call this first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch


def skip_unless_interpreted_or_cuda() -> None:
    """For modules that set TRITON_INTERPRET before importing the kernels: if another
    module defined them compiled first (Triton fixes the mode when a kernel is defined)
    and there is no GPU to run them, skip the module."""
    from radixserve.engine.attention.triton_ops.common import INTERPRETED

    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip(
            "the triton kernels were compiled in this process but there is no GPU",
            allow_module_level=True,
        )


def kernel_test_device(*, round_bf16: bool = False) -> torch.device:
    """For modules comparing kernels with their references: skip as
    skip_unless_interpreted_or_cuda does, then the device the kernels run on (the CPU
    under the interpreter); with `round_bf16`, the interpreter rounds float32 ->
    bfloat16 as compiled kernels do (round_bf16_to_nearest_even)."""
    from radixserve.engine.attention.triton_ops.common import INTERPRETED

    skip_unless_interpreted_or_cuda()
    if not INTERPRETED:
        return torch.device("cuda")
    if round_bf16:
        round_bf16_to_nearest_even()
    return torch.device("cpu")


def round_bf16_to_nearest_even() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "radixserve_rne", False):
        return

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        data = np.asarray(src.data, dtype=np.float32)
        bits = data.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[np.isnan(data)] = 0x7FC0
        return interpreter.TensorHandle(rounded.reshape(data.shape), tl.bfloat16)

    cast_impl.radixserve_rne = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl
