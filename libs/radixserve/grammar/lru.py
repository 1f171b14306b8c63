"""A least-recently-used map bounded by entry count and by total size."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedLru(Generic[V]):
    """`get` refreshes an entry; `put` evicts the oldest ones past either bound. An entry
    larger than `max_bytes` on its own is not kept (it would evict everything else)."""

    def __init__(self, max_entries: int, max_bytes: int, size_of: Callable[[V], int]) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V) -> None:
        size = self._size_of(value)
        self.pop(key)
        if size > self.max_bytes:
            return
        self._items[key] = (value, size)
        self.total_bytes += size
        while len(self._items) > self.max_entries or self.total_bytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.total_bytes -= evicted

    def pop(self, key: str) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.total_bytes -= item[1]
        return item[0]
