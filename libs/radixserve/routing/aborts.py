"""`RecentAborts`: aborts that arrived before their request, kept for a while.

The gateway may abort a request the tokenizer has not handed over yet (a client that
disconnects at once); the scheduler must then drop the request when it arrives
instead of running it. Bounded in time and size, so aborts of requests that never
arrive cannot pile up.
"""

from __future__ import annotations

from collections import OrderedDict


class RecentAborts:
    def __init__(self, ttl_s: float = 60.0, max_entries: int = 65536) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be > 0")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: OrderedDict[str, float] = OrderedDict()  # oldest first

    def add(self, rid: str, now: float) -> None:
        self._expiry.pop(rid, None)
        self._expiry[rid] = now + self.ttl_s
        while len(self._expiry) > self.max_entries:
            self._expiry.popitem(last=False)
        self.prune(now)

    def consume(self, rid: str, now: float) -> bool:
        """True (and forget it) when `rid` was aborted within the last `ttl_s`."""
        expiry = self._expiry.pop(rid, None)
        return expiry is not None and expiry >= now

    def prune(self, now: float) -> None:
        while self._expiry:
            rid, expiry = next(iter(self._expiry.items()))
            if expiry >= now:
                break
            del self._expiry[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)
