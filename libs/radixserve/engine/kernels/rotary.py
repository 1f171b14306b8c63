"""Neox-style rotary embeddings (rotate halves, not interleaved pairs) on q and k.

The Triton kernel reads each token's cos/sin row from the table by its position and
rounds each product and the sum to the input dtype, as `q * cos + rotate_half(q) *
sin` does in torch: it matches the reference bit for bit (float32 included: no fused
multiply-adds). It can also store the layer's new K/V rows in the same launch
(`apply_rotary_and_store`), which the attention backend would otherwise do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.engine.kernels import dispatch
from radixserve.engine.kernels.kv_store import KVWrite, triton_stores

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
        return _rotary_triton(q, k, rotation, None)
    cos, sin = rotation.cos_sin
    return rotary_torch(q, k, cos, sin)


def apply_rotary_and_store(
    q: torch.Tensor, k: torch.Tensor, rotation: Rotation, write: KVWrite | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """apply_rotary, and where the Triton kernels run, `write` with the rotated k in the
    same launch: (q, k, whether it stored). Elsewhere, or with no `write` (an FP8 pool
    quantizes in set_kv), nothing is stored (False) and the caller stores k and v (the
    attention backend's set_kv)."""
    if write is not None and rotation.cos_sin is None and triton_stores(k, write.v):
        return (*_rotary_triton(q, k, rotation, write), True)
    return (*apply_rotary(q, k, rotation), False)


def _rotary_triton(
    q: torch.Tensor, k: torch.Tensor, rotation: Rotation, write: KVWrite | None
) -> tuple[torch.Tensor, torch.Tensor]:
    from radixserve.engine.kernels.triton_ops.rotary import rotary_triton

    table = rotation.table
    return rotary_triton(q, k, rotation.positions, table.cos, table.sin, write)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, as Hugging Face Llama applies it; cos/sin broadcast over heads."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
