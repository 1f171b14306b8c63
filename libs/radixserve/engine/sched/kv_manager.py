"""Glue between requests and KV memory: rows, pages, and the prefix cache.

All slot ownership changes go through here, so the accounting invariant
free + evictable + protected + in-flight == pool size has one home.

Pages (page_size P, SGLang's paged layout): position i of a request lives in the
page of its (i // P)-th page entry, at offset i % P; req_to_token still maps
position -> slot, so the attention backends and the batch builder never see pages.
The prefix cache holds whole pages only: a request's prefix is whole cached pages,
and everything after it (its partial last page included) is the request's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import Req
from radixserve.engine.transfer import upload_int64


class OutOfKVMemory(RuntimeError):
    pass


@dataclass(frozen=True)
class KVUsage:
    pool_size: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    in_flight_tokens: int  # slots of pages owned by running requests outside the cache

    @property
    def used_tokens(self) -> int:
        return self.pool_size - self.free_tokens - self.evictable_tokens


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


class KVManager:
    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool, cache: PrefixCache) -> None:
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.cache = cache
        self.page_size = kv_pool.page_size

    # -- capacity ---------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots obtainable now: free plus what eviction can reclaim (whole pages)."""
        return self.kv_pool.available() + self.cache.sizes().evictable_tokens

    def slots_needed(self, req: Req, num_tokens: int) -> int:
        """Pool slots that extending `req` past kv_len by `num_tokens` takes: the free
        tail of its last page costs nothing, the rest comes in whole pages."""
        if self.page_size == 1:
            return num_tokens
        rest = num_tokens - (-req.kv_len % self.page_size)
        return _round_up(rest, self.page_size) if rest > 0 else 0

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        """Pool slots one decode step of `reqs` takes: a page for each request whose
        last page is full (kv_len % P == 0)."""
        if self.page_size == 1:
            return len(reqs)
        return sum(self.page_size for r in reqs if r.kv_len % self.page_size == 0)

    def max_extend_tokens(self, req: Req, slot_budget: int) -> int:
        """The most tokens `req` can extend by while taking at most `slot_budget` pool slots."""
        if self.page_size == 1:
            return slot_budget
        page = self.page_size
        return -req.kv_len % page + max(slot_budget, 0) // page * page

    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        """`num_tokens` (a whole number of pages) fresh slots, evicting cached pages if needed."""
        short = num_tokens - self.kv_pool.available()
        if short > 0:
            self.cache.evict(short)
        slots = self.kv_pool.alloc(num_tokens)
        if slots is None:
            raise OutOfKVMemory(
                f"need {num_tokens} KV slots, {self.kv_pool.available()} free after eviction"
            )
        return slots

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """`num_pages` fresh page ids (on the device), evicting cached pages if needed."""
        short = num_pages * self.page_size - self.kv_pool.available()
        if short > 0:
            self.cache.evict(short)
        pages = self.kv_pool.alloc_pages(num_pages)
        if pages is None:
            raise OutOfKVMemory(
                f"need {num_pages} KV pages, {self.kv_pool.available_pages()} free after eviction"
            )
        return pages

    # -- admission --------------------------------------------------------------
    def match(self, req: Req, load: bool = False) -> int:
        """Look up the cached prefix of the request's tokens (not locked yet). Returns its length
        (whole pages: the cache matches nothing shorter). `load`: the request is about to
        be admitted: bring what a lower tier (HiCache's host memory) holds of it back to
        the device first."""
        # NOTE: at least one token is always computed, so the match stops before the last.
        ids = req.fill_ids[:-1]
        if req.input_logprob_next > 0:  # prompt logprobs due: their queries are computed
            ids = ids[: req.input_logprob_next - 1]
        result = self.cache.match_prefix(ids, load=load)
        req.prefix_indices = result.indices
        req.last_node = result.node
        return result.length

    def admit(self, req: Req) -> None:
        """Give the request a row and lock its matched prefix."""
        row = self.req_pool.alloc()
        if row is None:
            raise OutOfKVMemory("no free request rows")
        assert req.prefix_indices is not None
        req.req_pool_idx = row
        prefix_len = int(req.prefix_indices.numel())
        if prefix_len:
            self.req_pool.req_to_token[row, :prefix_len] = req.prefix_indices.to(torch.int32)
        self.cache.inc_lock_ref(req.last_node)
        req.kv_len = prefix_len

    def assign_new_slots(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Give the request's next `num_tokens` positions (from kv_len on) slots and record them
        in its row: first the free tail of its last page, then whole new pages."""
        assert req.req_pool_idx is not None
        if self.page_size == 1:  # the hot path stays one allocation
            slots = self.alloc_slots(num_tokens)
        else:
            slots = self._paged_slots(req, num_tokens)
        start = req.kv_len
        self.req_pool.req_to_token[req.req_pool_idx, start : start + num_tokens] = slots.to(
            torch.int32
        )
        return slots

    def assign_decode_slots(self, reqs: list[Req]) -> None:
        """`assign_new_slots(req, 1)` for every request of a decode step at once.

        The slots are the ones the per-request calls would give, in the same order: a
        request whose last page is full takes the next fresh page (all of them in one
        allocation, in request order), the others the slot after their last one. One
        allocation on the device, one upload (rows, lengths) and one scatter into
        req_to_token, whatever the batch size, and no device-to-host read.
        """
        if not reqs:
            return
        page = self.page_size
        bs = len(reqs)
        rows: list[int] = []
        kv_lens: list[int] = []
        for req in reqs:
            assert req.req_pool_idx is not None
            rows.append(req.req_pool_idx)
            kv_lens.append(req.kv_len)
        table = self.req_pool.req_to_token
        if page == 1:
            slots = self.alloc_pages(bs)
            rows_t, lens_t = upload_int64(rows + kv_lens, table.device).view(2, bs)
            table[rows_t, lens_t] = slots.to(table.dtype)
            return
        # Requests whose last page is full (kv_len % page == 0) start a new page.
        needy = [i for i, n in enumerate(kv_lens) if n % page == 0]
        pages = self.alloc_pages(len(needy))
        packed = upload_int64(rows + kv_lens + needy, table.device)
        rows_t, lens_t = packed[: 2 * bs].view(2, bs)
        if len(needy) == bs:
            slots = pages * page
        else:
            # The slot after the last token's, on the same page (read on the device).
            slots = table[rows_t, lens_t - 1].to(torch.int64) + 1
            if needy:
                slots[packed[2 * bs :]] = pages * page
        table[rows_t, lens_t] = slots.to(table.dtype)

    def _paged_slots(self, req: Req, num_tokens: int) -> torch.Tensor:
        table = self.req_pool.req_to_token
        start = req.kv_len
        parts: list[torch.Tensor] = []
        tail = min(-start % self.page_size, num_tokens)
        if tail:
            # The slots right after the last token's, on the same page (kept on the device:
            # reading the slot back would cost a sync per request per step).
            last = table[req.req_pool_idx, start - 1 : start].to(torch.int64)
            parts.append(last + torch.arange(1, tail + 1, dtype=torch.int64, device=table.device))
        rest = num_tokens - tail
        if rest > 0:
            # Only the last new page can be partial; its unused slots stay the request's.
            parts.append(self.alloc_slots(_round_up(rest, self.page_size))[:rest])
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=table.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def unassign_new_slots(self, req: Req, num_tokens: int) -> None:
        """Undo assign_new_slots(req, num_tokens) before the forward ran: free the pages it
        allocated (the tail of the old last page stays the request's)."""
        row = req.req_pool_idx
        assert row is not None
        first_new = _round_up(req.kv_len, self.page_size)
        end = req.kv_len + num_tokens
        if end > first_new:
            self.kv_pool.free(self.req_pool.req_to_token[row, first_new:end].to(torch.int64))

    # -- caching ----------------------------------------------------------------
    def _insert_computed(self, req: Req) -> list[int]:
        """Put the whole pages the request has computed into the cache; free the request's
        pages the cache already held. Returns the inserted tokens."""
        assert req.req_pool_idx is not None and req.prefix_indices is not None
        aligned = req.kv_len // self.page_size * self.page_size
        token_ids = req.fill_ids[:aligned]
        kv_indices = self.req_pool.req_to_token[req.req_pool_idx, :aligned].to(torch.int64)
        prefix_len = int(req.prefix_indices.numel())
        new_prefix_len = self.cache.insert(token_ids, kv_indices)
        # Pages another request cached for the same tokens meanwhile are duplicates (whole
        # pages: both lengths are page multiples).
        if new_prefix_len > prefix_len:
            self.kv_pool.free(kv_indices[prefix_len:new_prefix_len])
        return token_ids

    def release(self, req: Req) -> None:
        """The request is done with its KV (finished, aborted or retracted): cache what it
        computed, free its partial last page, unlock its prefix and give back its row."""
        row = req.req_pool_idx
        if row is None:
            return
        self._insert_computed(req)
        aligned = req.kv_len // self.page_size * self.page_size
        if req.kv_len > aligned:  # the partial last page: never cached, the request's alone
            self.kv_pool.free(self.req_pool.req_to_token[row, aligned : req.kv_len].to(torch.int64))
        self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        req.req_pool_idx = None
        req.prefix_indices = None
        req.last_node = None
        req.kv_len = 0

    def cache_unfinished(self, req: Req) -> None:
        """Between prefill chunks: put the computed whole pages in the cache and re-lock them
        there, so the request's own pages become shared (and deduplicated). A partial last
        page stays the request's."""
        if not self.cache.reuses_prefixes:
            return  # nothing is shared: the request keeps owning its pages
        token_ids = self._insert_computed(req)
        result = self.cache.match_prefix(token_ids)
        assert result.length == len(token_ids), "a just-inserted prefix must match in full"
        assert req.req_pool_idx is not None
        self.req_pool.req_to_token[req.req_pool_idx, : result.length] = result.indices.to(
            torch.int32
        )
        self.cache.dec_lock_ref(req.last_node)
        self.cache.inc_lock_ref(result.node)
        req.prefix_indices = result.indices
        req.last_node = result.node

    # -- accounting -------------------------------------------------------------
    def owned_tokens(self, req: Req) -> int:
        """Slots of the pages the request owns outright (not shared through the cache): from
        its prefix to the end of its last page, the partial last page counting fully.
        Counted between steps, when every assigned slot holds KV (kv_len)."""
        if req.req_pool_idx is None:
            return 0
        prefix = 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        return _round_up(req.kv_len, self.page_size) - prefix

    def usage(self, holders: list[Req]) -> KVUsage:
        sizes = self.cache.sizes()
        return KVUsage(
            pool_size=self.kv_pool.size,
            free_tokens=self.kv_pool.available(),
            evictable_tokens=sizes.evictable_tokens,
            protected_tokens=sizes.protected_tokens,
            in_flight_tokens=sum(self.owned_tokens(r) for r in holders),
        )

    def check_invariants(self, holders: list[Req]) -> None:
        """free + evictable + protected + in-flight == pool size, every page has exactly one
        owner (free list, cache, or one request), and requests' rows follow the page layout."""
        self.cache.check_invariants()
        u = self.usage(holders)
        total = u.free_tokens + u.evictable_tokens + u.protected_tokens + u.in_flight_tokens
        assert total == u.pool_size, f"KV accounting broken: {u} sums to {total}"
        rows = [r.req_pool_idx for r in holders if r.req_pool_idx is not None]
        assert len(rows) == len(set(rows)), "a request row is held twice"
        assert self.req_pool.available() + len(rows) == self.req_pool.max_reqs
        self._check_page_owners(holders)

    def _check_page_owners(self, holders: list[Req]) -> None:
        page, num_pages = self.page_size, self.kv_pool.num_pages
        free = self.kv_pool.free_pages().cpu()
        assert free.unique().numel() == free.numel(), "a KV page is on the free list twice"
        cached = torch.bincount(self.cache.cached_slots().cpu() // page, minlength=num_pages + 1)
        assert bool(((cached == 0) | (cached == page)).all()), "a KV page is only partly cached"
        owners = [free, cached.nonzero().flatten()]
        table = self.req_pool.req_to_token
        for req in holders:
            if req.req_pool_idx is None:
                continue
            assert req.prefix_indices is not None
            slots = table[req.req_pool_idx, : req.kv_len].to(torch.int64).cpu()
            prefix = int(req.prefix_indices.numel())
            assert prefix % page == 0, f"request {req.rid}: prefix of {prefix} is not whole pages"
            assert torch.equal(slots[:prefix], req.prefix_indices.cpu()), (
                f"request {req.rid}: row disagrees with its cached prefix"
            )
            self._check_layout(req, slots)
            own = torch.unique_consecutive(slots[prefix:] // page)
            assert own.numel() == _round_up(slots.numel() - prefix, page) // page, (
                f"request {req.rid}: two page entries share a page"
            )
            owners.append(own)
        counts = torch.bincount(torch.cat(owners), minlength=num_pages + 1)
        assert int(counts[0]) == 0, "the reserved page 0 is in use"
        twice = (counts[1:] > 1).nonzero().flatten() + 1
        assert twice.numel() == 0, f"KV pages owned twice: {twice[:8].tolist()}"
        lost = (counts[1:] == 0).nonzero().flatten() + 1
        assert lost.numel() == 0, f"KV pages owned by nobody (leaked): {lost[:8].tolist()}"

    def _check_layout(self, req: Req, slots: torch.Tensor) -> None:
        """Position i sits at offset i % P of the page that starts its page entry."""
        page = self.page_size
        if page == 1:
            return
        pos = torch.arange(slots.numel())
        offset = pos % page
        assert bool((slots % page == offset).all()), f"request {req.rid}: slot at wrong offset"
        entry_start = slots[pos - offset]
        assert bool((slots - entry_start == offset).all()), (
            f"request {req.rid}: a page entry spans two pages"
        )
