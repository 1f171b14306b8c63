"""The no-reuse prefix cache (`disable_radix_cache`): it never matches and keeps nothing.

Contract (base.py): insert returns len(key), i.e. "all of it is the caller's", so the
scheduler's usual `kv_pool.free(kv_indices[prefix_len:new_prefix_len])` hands every
slot straight back to the pool (prefix_len is always 0 here). The cache itself never
touches the pool, so slots have a single owner that frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.engine.kvcache.base import CacheSizes, MatchResult, PrefixCache
from radixserve.engine.kvcache.pool import KVPool


class _EmptyMatch:
    """The one handle this cache hands out; locking it protects nothing."""

    def __repr__(self) -> str:
        return "NaiveCache.root"


class NaiveCache(PrefixCache):
    reuses_prefixes = False

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self._root = _EmptyMatch()
        self._locks = 0  # counted only to catch unbalanced inc/dec in the scheduler

    def match_prefix(self, key: Sequence[int], load: bool = False) -> MatchResult:
        empty = torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)
        return MatchResult(indices=empty, node=self._root)

    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        if indices.dim() != 1 or indices.dtype != torch.int64 or indices.numel() != len(key):
            raise ValueError(
                f"need a 1-D int64 tensor of {len(key)} slots, got {indices.dtype} "
                f"of shape {tuple(indices.shape)}"
            )
        return len(key)  # nothing kept: the caller frees every slot it passed in

    def inc_lock_ref(self, node: Any) -> None:
        self._check_handle(node)
        self._locks += 1

    def dec_lock_ref(self, node: Any) -> None:
        self._check_handle(node)
        if self._locks == 0:
            raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
        self._locks -= 1

    def _check_handle(self, node: Any) -> None:
        if node is not self._root:
            raise TypeError(f"expected a handle from this NaiveCache's match_prefix, got {node!r}")

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return 0

    def sizes(self) -> CacheSizes:
        return CacheSizes(evictable_tokens=0, protected_tokens=0)

    def cached_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        if self._locks:
            raise RuntimeError("NaiveCache.reset() while requests still hold locks on it")

    def check_invariants(self) -> None:
        assert self._locks >= 0, "negative lock count"

    def __repr__(self) -> str:
        return f"NaiveCache(locks={self._locks})"
