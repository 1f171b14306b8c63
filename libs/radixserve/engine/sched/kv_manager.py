"""Glue between requests and KV memory: rows, slots, and the prefix cache.

All slot ownership changes go through here, so the accounting invariant
free + evictable + protected + in-flight == pool size has one home.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import Req


class OutOfKVMemory(RuntimeError):
    pass


@dataclass(frozen=True)
class KVUsage:
    pool_size: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    in_flight_tokens: int  # slots owned by running requests outside the cache

    @property
    def used_tokens(self) -> int:
        return self.pool_size - self.free_tokens - self.evictable_tokens


class KVManager:
    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool, cache: PrefixCache) -> None:
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.cache = cache

    # -- capacity ---------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots obtainable now: free plus what eviction can reclaim."""
        return self.kv_pool.available() + self.cache.sizes().evictable_tokens

    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.kv_pool.available():
            self.cache.evict(num_tokens - self.kv_pool.available())
        slots = self.kv_pool.alloc(num_tokens)
        if slots is None:
            raise OutOfKVMemory(
                f"need {num_tokens} KV slots, {self.kv_pool.available()} free after eviction"
            )
        return slots

    # -- admission --------------------------------------------------------------
    def match(self, req: Req) -> int:
        """Look up the cached prefix of the request's tokens (not locked yet). Returns its length."""
        # NOTE: at least one token is always computed, so the match stops before the last.
        result = self.cache.match_prefix(req.fill_ids[:-1])
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
        """Allocate slots for the request's next `num_tokens` tokens and record them in its row."""
        assert req.req_pool_idx is not None
        slots = self.alloc_slots(num_tokens)
        start = req.kv_len
        self.req_pool.req_to_token[req.req_pool_idx, start : start + num_tokens] = slots.to(
            torch.int32
        )
        return slots

    # -- caching ----------------------------------------------------------------
    def _insert_computed(self, req: Req) -> tuple[list[int], torch.Tensor]:
        assert req.req_pool_idx is not None and req.prefix_indices is not None
        token_ids = req.fill_ids[: req.kv_len]
        kv_indices = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        prefix_len = int(req.prefix_indices.numel())
        new_prefix_len = self.cache.insert(token_ids, kv_indices)
        # Slots another request cached for the same tokens meanwhile are duplicates.
        if new_prefix_len > prefix_len:
            self.kv_pool.free(kv_indices[prefix_len:new_prefix_len])
        return token_ids, kv_indices

    def release(self, req: Req) -> None:
        """The request is done with its KV (finished, aborted or retracted): cache what it
        computed, unlock its prefix and give back its row."""
        if req.req_pool_idx is None:
            return
        self._insert_computed(req)
        self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = None
        req.last_node = None
        req.kv_len = 0

    def cache_unfinished(self, req: Req) -> None:
        """Between prefill chunks: put the computed part in the cache and re-lock it there,
        so the request's own slots become shared (and deduplicated)."""
        if not self.cache.reuses_prefixes:
            return  # nothing is shared: the request keeps owning its slots
        token_ids, _ = self._insert_computed(req)
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
    def usage(self, holders: list[Req]) -> KVUsage:
        sizes = self.cache.sizes()
        return KVUsage(
            pool_size=self.kv_pool.size,
            free_tokens=self.kv_pool.available(),
            evictable_tokens=sizes.evictable_tokens,
            protected_tokens=sizes.protected_tokens,
            in_flight_tokens=sum(r.owned_kv_tokens for r in holders if r.req_pool_idx is not None),
        )

    def check_invariants(self, holders: list[Req]) -> None:
        """free + evictable + protected + in-flight == pool size, and no slot owned twice."""
        self.cache.check_invariants()
        u = self.usage(holders)
        total = u.free_tokens + u.evictable_tokens + u.protected_tokens + u.in_flight_tokens
        assert total == u.pool_size, f"KV accounting broken: {u} sums to {total}"
        free = self.kv_pool._free_slots
        assert len(free) == len(set(free)), "a KV slot is on the free list twice"
        rows = [r.req_pool_idx for r in holders if r.req_pool_idx is not None]
        assert len(rows) == len(set(rows)), "a request row is held twice"
        assert self.req_pool.available() + len(rows) == self.req_pool.max_reqs
