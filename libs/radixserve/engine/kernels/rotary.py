"""Neox-style rotary embeddings (rotate halves, not interleaved pairs) on q and k.

The Triton kernel reads each token's cos/sin row from the table by its position and
rounds each product and the sum to the input dtype, as `q * cos + rotate_half(q) *
sin` does in torch: it matches the reference bit for bit (float32 included: no fused
multiply-adds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.engine.kernels import dispatch

if TYPE_CHECKING:
    from radixserve.engine.model.rope import RotaryTable


@dataclass(frozen=True)
class Rotation:
    """The rotary input of one forward pass, shared by every layer: the tokens'
    positions, and on the torch path their cos/sin rows, gathered once per pass."""

    positions: torch.Tensor  # [num_tokens] int64
    table: RotaryTable
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # [num_tokens, 1, head_dim] each

    @classmethod
    def of(cls, table: RotaryTable, positions: torch.Tensor) -> Rotation:
        if dispatch.use_triton(positions):
            return cls(positions, table, None)  # the kernel reads the table itself
        return cls(positions, table, table.lookup(positions))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rotation: Rotation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], as new
    contiguous tensors; q and k may be strided views (of the fused qkv output)."""
    if rotation.cos_sin is None:
        from radixserve.engine.kernels.triton_ops.rotary import rotary_triton

        table = rotation.table
        return rotary_triton(q, k, rotation.positions, table.cos, table.sin)
    cos, sin = rotation.cos_sin
    return rotary_torch(q, k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, as Hugging Face Llama applies it; cos/sin broadcast over heads."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
