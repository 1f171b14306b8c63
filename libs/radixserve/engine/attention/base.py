"""The one seam between the model and attention kernels.

The model calls `forward` once per layer; the backend stores the new K/V into the
pool and attends over each request's whole KV (cached prefix + new tokens, causal
within the new tokens). Backends own their per-batch metadata: `init_forward_metadata`
runs once per pass, before the first layer, so per-layer calls stay cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixserve.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "base"

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare index tables/masks for this batch (called once per forward pass)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (new tokens only)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v to batch.kv_pool at batch.out_cache_loc, then attend."""
