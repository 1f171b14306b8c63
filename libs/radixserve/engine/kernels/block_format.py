"""The weight type of block-quantized projections (a GGUF's blocks), apart from the
kernels over it so that kernels/block_quant.py and triton_ops/block_quant.py both
import it (as fp8_format.py is for FP8)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockQuantWeight(NamedTuple):
    """A projection's weight [n, k] as codes with per-block scales (and mins)."""

    codes: torch.Tensor  # uint8 [n, k / 2] (4-bit: element 2j low nibble of byte j) or int8 [n, k]
    scales: torch.Tensor  # float16 or float32 [n, k / block]
    mins: torch.Tensor | None  # like scales; None: w = scale * q

    @property
    def bits(self) -> int:
        return 8 if self.codes.dtype == torch.int8 else 4

    @property
    def shape(self) -> torch.Size:
        n, width = self.codes.shape
        return torch.Size((n, width * (8 // self.bits)))

    @property
    def block(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
