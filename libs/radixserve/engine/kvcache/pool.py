"""KV memory: per-layer K/V buffers and a free list of pages of `page_size` slots.

Page p holds slots [p * page_size, (p + 1) * page_size). Page 0 holds the reserved
slot 0 and is never handed out: padded index tables point at slot 0, so a kernel that
reads past a request's length reads harmless zeros instead of another request's KV.
With page_size 1 a page is a slot and the free list is the list of free slots.

The free list lives on the pool's device (SGLang's TokenToKVPoolAllocator): an
allocation slices page ids off its front, a free appends the freed tensor, and the
host keeps only the count. Neither ever reads the device, so finishing a request or
evicting from the cache costs no host round trip.

An FP8 pool (dtype float8_e4m3fn, EngineConfig.kv_cache_dtype "fp8_e4m3") stores
e4m3 codes with one K and one V scale per layer (kvcache/fp8.py): `set_kv` quantizes,
the attention backends widen what they read by `scales[layer]`. Half the bytes of a
16-bit pool per token, so the same memory holds twice the tokens.
"""

from __future__ import annotations

import torch

from radixserve.engine.kernels.kv_store import KVWrite, store_kv
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale, is_fp8, quantize, widen


class KVPool:
    """KV buffers for every layer, addressed by slot; allocation in whole pages of `page_size` slots.

    `debug=True` checks every free against per-page free flags (on the device) and
    raises on a double free, a reserved page or slots out of page order; the check
    reads the device, so it is off by default, for every page size.
    """

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
        pin_memory: bool = False,
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
        self.dtype = dtype  # what the buffers store: the model's dtype, or FP8 codes
        self.quantized = is_fp8(dtype)
        # Fixed once the model is loaded (set_scales): CUDA graphs bake them in.
        self.scales = [UNIT_SCALE] * num_layers
        self.debug = debug
        # Canonical form ("cuda" -> "cuda:0"), so device comparisons hold.
        self.device = torch.empty(0, device=device).device
        # One extra page in front holds the reserved padding slot 0.
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        # pin_memory: a host pool under a GPU's (HiCache), so copies to and from it
        # need not wait for the device.
        self.k_buffers, self.v_buffers = (
            [
                torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
                for _ in range(num_layers)
            ]
            for _ in "kv"
        )
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        # Free page ids in hand-out order: `_head`, then the `_released` blocks (pages
        # freed since the head was last refilled) in the order they came back.
        self._head = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []
        self._num_free = self.num_pages  # len(_head) + the blocks' lengths, known on the host
        # Debug only: a free flag per page, to catch a double free at the point of the free.
        self._page_is_free = (
            torch.arange(self.num_pages + 1, device=self.device) > 0 if self.debug else None
        )

    def available(self) -> int:
        """Free slots (always whole pages)."""
        return self._num_free * self.page_size

    def available_pages(self) -> int:
        return self._num_free

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
        pages = self.alloc_pages(num_tokens // page)
        if pages is None or page == 1:
            return pages
        return (pages[:, None] * page + self._page_offsets).reshape(-1)

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Hand out `num_pages` whole pages as page ids (int64, on the pool's device; page p
        holds slots [p * page_size, (p + 1) * page_size)), or None if too few are free."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self._num_free:
            return None
        if num_pages > self._head.numel():
            self._head = torch.cat([self._head, *self._released])
            self._released = []
        taken, self._head = self._head[:num_pages], self._head[num_pages:]
        self._num_free -= num_pages
        if self._page_is_free is not None:
            self._page_is_free[taken] = False
        return taken

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages the given slots lie in, each whole, once.

        `slots` run page by page as a request's row holds them: slot i lies in the page
        of slot i - i % page_size (a run from a page start, a partial last page allowed).
        The pool keeps the tensor (page_size 1): the caller must not write to it later.
        """
        if slots.numel() == 0:
            return
        slots = slots.to(self.device, torch.int64)
        pages = slots if self.page_size == 1 else slots[:: self.page_size] // self.page_size
        if self._page_is_free is not None:
            self._check_free(slots, pages, self._page_is_free)
        self._num_free += pages.numel()
        # Blocks shrink by more than half from left to right (adjacent ones merge), so
        # there are O(log pool) of them and each page is copied O(log pool) times.
        blocks = self._released
        blocks.append(pages)
        while len(blocks) > 1 and blocks[-2].numel() <= 2 * blocks[-1].numel():
            last = blocks.pop()
            blocks[-1] = torch.cat([blocks[-1], last])

    def _check_free(self, slots: torch.Tensor, pages: torch.Tensor, is_free: torch.Tensor) -> None:
        """Debug: raise (changing nothing) unless `pages` may be freed; then flag them free."""
        touched = torch.unique_consecutive(slots // self.page_size)
        bad = touched[(touched < 1) | (touched > self.num_pages)]
        if bad.numel() == 0:
            bad = touched[is_free[touched]]
        if bad.numel() or touched.unique().numel() != touched.numel():
            shown = (bad if bad.numel() else touched)[:8].tolist()
            raise RuntimeError(f"KV pages freed twice or not allocatable: {shown}")
        in_order = pages.repeat_interleave(self.page_size)[: slots.numel()]
        if not torch.equal(slots // self.page_size, in_order):
            raise RuntimeError(
                "KV slots to free are out of page order: slot i must lie in the page of "
                "slot i - i % page_size"
            )
        is_free[pages] = True

    def free_pages(self) -> torch.Tensor:
        """The free page ids (a copy, on the device), in hand-out order; for invariant checks."""
        return torch.cat([self._head, *self._released])

    def free_page_ids(self) -> list[int]:
        """The free list on the host, in hand-out order; for invariant checks and tests."""
        return self.free_pages().tolist()

    def free_slot_ids(self) -> list[int]:
        """Every free slot, page by page in free-list order; for invariant checks."""
        pages = self.free_pages()
        if self.page_size == 1:
            return pages.tolist()
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1).tolist()

    def set_scales(self, scales: list[KVScale]) -> None:
        """Each layer's K/V scales (an FP8 pool's; a 16-bit pool takes only 1.0), before
        anything is stored."""
        if len(scales) != self.num_layers:
            raise ValueError(f"{len(scales)} KV scales for {self.num_layers} layers")
        if not self.quantized and any(s != UNIT_SCALE for s in scales):
            raise ValueError(f"a {self.dtype} KV pool stores K/V unscaled")
        self.scales = list(scales)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantized:
            scale = self.scales[layer_id]
            k, v = quantize(k, scale.k), quantize(v, scale.v)
        store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], loc, k, v)

    def as_stored(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v as reading them back from the pool gives them (in k's dtype): an FP8
        pool's codes times the scales; k and v themselves otherwise. For kernels that
        take a pass's new K/V from the projection rather than from the pool, so that
        they attend the values every other read sees."""
        if not self.quantized:
            return k, v
        scale = self.scales[layer_id]
        return (
            widen(quantize(k, scale.k), scale.k, k.dtype),
            widen(quantize(v, scale.v), scale.v, v.dtype),
        )

    def kv_write(self, layer_id: int, loc: torch.Tensor, v: torch.Tensor) -> KVWrite | None:
        """set_kv(layer_id, loc, k, v) with k still to come: for a kernel that makes k
        and stores it in the same launch (kernels/rotary.apply_rotary_and_store). None
        for an FP8 pool: that kernel casts without scaling, so set_kv stores."""
        if self.quantized:
            return None
        return KVWrite(self.k_buffers[layer_id], self.v_buffers[layer_id], loc, v)

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
