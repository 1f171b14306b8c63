"""KV memory: per-layer K/V buffers and a free list of pages of `page_size` slots.

Page p holds slots [p * page_size, (p + 1) * page_size). Page 0 holds the reserved
slot 0 and is never handed out: padded index tables point at slot 0, so a kernel that
reads past a request's length reads harmless zeros instead of another request's KV.
With page_size 1 a page is a slot and the free list is the list of free slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload_int64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, in one host-to-device copy that does not
    wait for the device: on CUDA from pinned memory (the caching host allocator keeps
    the buffer until the copy has run), so the host goes on while queued work runs.
    A plain `torch.tensor(values, device=...)` would synchronise the stream."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


class KVPool:
    """KV buffers for every layer, addressed by slot; allocation in whole pages of `page_size` slots."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
        debug: bool = False,
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
        self.num_pages = num_slots // page_size
        self.num_layers = num_layers
        self.dtype = dtype
        # Page size 1 tracks free flags only in debug mode: its hot path stays a list
        # append; pages > 1 always check (a slip there would hand one page out twice).
        self.track_free_flags = debug or page_size > 1
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
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        # Free pages live on the host: allocation is a Python slice, and the scheduler
        # needs the counts every step anyway.
        self._free_pages = list(range(1, self.num_pages + 1))
        # Free flags per page catch a double free at the point of the free.
        self._page_is_free = bytearray([0]) + bytearray([1]) * self.num_pages

    def available(self) -> int:
        """Free slots (always whole pages)."""
        return len(self._free_pages) * self.page_size

    def available_pages(self) -> int:
        return len(self._free_pages)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Hand out `num_tokens` slots (int64, on the pool's device), or None if too few are free.

        `num_tokens` must be a whole number of pages; the slots come page by page, each
        page in order, so slot i of the result sits at offset i % page_size of its page.
        """
        page = self.page_size
        if num_tokens < 0 or num_tokens % page:
            raise ValueError(
                f"alloc needs a whole number of pages: {num_tokens} slots with page_size {page}"
            )
        taken = self.alloc_pages(num_tokens // page)
        if taken is None:
            return None
        pages = upload_int64(taken, self.device)
        if page == 1:
            return pages
        return (pages[:, None] * page + self._page_offsets).reshape(-1)

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Hand out `num_pages` whole pages as page ids on the host (page p holds slots
        [p * page_size, (p + 1) * page_size)), or None if too few are free. For callers
        that upload the ids together with other per-step values."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free_pages):
            return None
        taken = self._free_pages[:num_pages]
        del self._free_pages[:num_pages]
        if self.track_free_flags:
            for p in taken:
                self._page_is_free[p] = 0
        return taken

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages the given slots lie in. The caller must own every slot of
        those pages (a page is freed whole, once)."""
        if slots.numel() == 0:
            return
        if not self.track_free_flags:
            self._free_pages.extend(slots.tolist())
            return
        # A request's slots run page by page, so one page's slots are adjacent.
        pages = (
            slots.tolist()
            if self.page_size == 1
            else torch.unique_consecutive(slots // self.page_size).tolist()
        )
        bad = [p for p in pages if not 1 <= p <= self.num_pages or self._page_is_free[p]]
        if bad or len(set(pages)) != len(pages):
            raise RuntimeError(
                f"KV pages freed twice or not allocatable: {bad or sorted(pages)[:8]}"
            )
        for p in pages:
            self._page_is_free[p] = 1
        self._free_pages.extend(pages)

    def free_page_ids(self) -> list[int]:
        """The free list (a copy), in hand-out order; for invariant checks."""
        return list(self._free_pages)

    def free_slot_ids(self) -> list[int]:
        """Every free slot, page by page in free-list order; for invariant checks."""
        if self.page_size == 1:
            return list(self._free_pages)
        page = self.page_size
        return [p * page + i for p in self._free_pages for i in range(page)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    @staticmethod
    def bytes_per_token_for(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """KV bytes one token takes over all layers (K and V): what sizes a pool."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class ReqToTokenPool:
    """Maps a running request's row to the KV slots of its tokens, position by position.

    Rows 0..max_reqs-1 are handed out; one more row, `padding_row`, is never handed out
    and stays all zeros (the reserved slot 0): padded batches (CUDA graph replays) point
    their padding requests at it, so those read and write only slot 0.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.padding_row = max_reqs
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context_len), dtype=torch.int32, device=device
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
