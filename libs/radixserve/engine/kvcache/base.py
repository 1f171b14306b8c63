"""The prefix-cache seam: a radix tree, or a cache that never reuses anything.

"Disable the radix cache" picks the other class once at start-up; the scheduler
never asks which one it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MatchResult:
    """The cached part of a key: its KV slots and a handle to lock/unlock it."""

    indices: torch.Tensor  # int64 KV slots of the matched prefix, in token order
    node: Any  # opaque handle for inc_lock_ref / dec_lock_ref
    # Tokens after `indices` whose KV a lower tier holds (a HiRadixCache's host memory):
    # match again with load=True to have them on the device.
    host_length: int = 0

    @property
    def length(self) -> int:
        return int(self.indices.numel())


@dataclass(frozen=True)
class CacheSizes:
    evictable_tokens: int  # cached, unlocked: can be evicted to free slots
    protected_tokens: int  # cached, locked by a running request


class PrefixCache(ABC):
    # False for the no-reuse cache: its insert keeps nothing and returns len(key), so
    # the caller frees every slot it passed in.
    reuses_prefixes: bool = True

    @abstractmethod
    def match_prefix(self, key: list[int], load: bool = False) -> MatchResult:
        """Longest cached prefix of `key` on the device. Touches the matched nodes for LRU.
        `load`: first bring what a lower tier holds of it back to the device, as far as
        device memory allows (for a request about to be admitted)."""

    @abstractmethod
    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Cache key -> slots. Returns how many leading tokens were already cached;
        the caller owns (and must free) its slots for that part, the cache owns the rest.
        A cache that keeps nothing returns len(key)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path root..node from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref on the same node."""

    def path(self, node: Any) -> list[tuple[int, int]]:
        """(an id, the tokens from the root to its end) for each node from the root's
        child down to `node`: requests whose paths hold the same id share those first
        tokens' KV slots (cascade attention groups them). Empty for a cache that keeps
        nothing."""
        return []

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first,
        back to the KV pool. Returns how many were freed (may be fewer if not enough are evictable)."""

    @abstractmethod
    def sizes(self) -> CacheSizes: ...

    @abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every KV slot the cache holds, evictable or protected: int64 (invariant checks)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry (flush_cache); only valid when nothing is locked.
        Does not free slots: the caller clears the pool."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent (tests call this)."""
