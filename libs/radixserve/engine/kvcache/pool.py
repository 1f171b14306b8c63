"""Token-granular KV memory: per-layer K/V buffers and a free list of slots.

Slot 0 is reserved and never handed out: padded index tables point at it, so a
kernel that reads past a request's length reads harmless zeros instead of another
request's KV.
"""

from __future__ import annotations

import torch


class KVPool:
    """KV buffers for every layer, addressed by slot; allocation in pages of `page_size` slots."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        num_slots = (num_slots // page_size) * page_size
        if num_slots <= 0:
            raise ValueError(
                "KV pool would hold no slots; raise the token budget or memory fraction"
            )
        self.size = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        # Canonical form ("cuda" -> "cuda:0"), so device comparisons hold.
        self.device = torch.empty(0, device=device).device
        # One extra page in front holds the reserved padding slot 0.
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k_buffers = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.clear()

    def clear(self) -> None:
        # Free slots live on the host: allocation is a Python slice, and the scheduler
        # needs the counts every step anyway.
        self._free_slots = list(range(self.page_size, self.size + self.page_size))

    def available(self) -> int:
        return len(self._free_slots)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Hand out `num_tokens` slots (int64, on the pool's device), or None if too few are free."""
        if num_tokens > len(self._free_slots):
            return None
        taken = self._free_slots[:num_tokens]
        del self._free_slots[:num_tokens]
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self._free_slots.extend(slots.tolist())

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * self.num_layers * k.shape[1] * k.shape[2] * k.element_size()


class ReqToTokenPool:
    """Maps a running request's row to the KV slots of its tokens, position by position."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            (max_reqs, max_context_len), dtype=torch.int32, device=device
        )
        self._free_rows = list(range(max_reqs))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.max_reqs))
