"""`InflightTable`: every routed, unfinished request -> the worker holding it.

A request with `n` choices finishes once per choice `index`; it leaves the table when
all `n` have finished, or at the first abort (the worker stops every choice). The
table remembers when each of the last `max_ended` requests left it (finished, failed,
aborted, its worker lost): the gateway's lost-request check asks about them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from radixserve.protocol import TokenizedRequest

# At 1000 requests a second, the last ~2 minutes of ends.
MAX_ENDED = 131072


@dataclass
class InflightEntry:
    rid: str
    worker_id: str
    gateway_id: str  # where an error for it goes (e.g. worker_lost)
    choices: int  # sampling.n
    routed_at: float  # wall clock
    finished_choices: set[int] = field(default_factory=set)
    # To re-route it if its worker dies: the request as tokenized, the ids each unfinished
    # choice generated so far (by index; packed int32, as the worker sent them), and
    # re-routes so far. `request` None (adopted, or a hole in what was seen of one of its
    # choices): it cannot be re-routed.
    request: TokenizedRequest | None = None
    generated: dict[int, bytearray] = field(default_factory=dict)
    attempt: int = 0
    # Since when its worker's heartbeats no longer list it (its end lost on the way).
    unlisted_since: float | None = None

    def on_progress(self, index: int, new_token_ids: bytes, completion_tokens: int) -> None:
        """Keep choice `index`'s new ids; a step that does not continue what was kept (one
        missed) makes the request one that cannot be re-routed."""
        if self.request is None:
            return
        kept = self.generated.setdefault(index, bytearray())
        if completion_tokens - len(new_token_ids) // 4 != len(kept) // 4:
            self.request = None
            self.generated = {}
            return
        kept += new_token_ids

    def prefixes(self) -> list[bytes | None]:
        """Per choice index, what it generated so far (packed), or None once finished."""
        return [
            None if index in self.finished_choices else bytes(self.generated.get(index, b""))
            for index in range(self.choices)
        ]


class InflightTable:
    def __init__(
        self, max_ended: int = MAX_ENDED, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._entries: dict[str, InflightEntry] = {}
        self._per_worker: dict[str, int] = {}
        self.max_ended = max_ended
        self._clock = clock
        self._ended: OrderedDict[str, float] = OrderedDict()  # rid -> when, oldest first

    def add(self, entry: InflightEntry) -> None:
        if entry.rid in self._entries:
            raise ValueError(f"request {entry.rid!r} is already in flight")
        self._entries[entry.rid] = entry
        self._per_worker[entry.worker_id] = self._per_worker.get(entry.worker_id, 0) + 1

    def finish_choice(self, rid: str, index: int, *, whole: bool = False) -> InflightEntry | None:
        """Mark choice `index` of `rid` finished (`whole`: every choice, e.g. an abort);
        the entry, removed, once the whole request has finished, else None."""
        entry = self._entries.get(rid)
        if entry is None:
            return None
        entry.finished_choices.add(index)
        entry.generated.pop(index, None)  # not run again
        if whole or len(entry.finished_choices) >= entry.choices:
            return self.remove(rid)
        return None

    def remove(self, rid: str) -> InflightEntry | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            left = self._per_worker[entry.worker_id] - 1
            if left:
                self._per_worker[entry.worker_id] = left
            else:
                del self._per_worker[entry.worker_id]
            self._ended[rid] = self._clock()
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
        return entry

    def ended_ago(self, rid: str) -> float | None:
        """Seconds since `rid` left the table; None if it is in flight, was never here,
        or ended longer ago than the table remembers."""
        ended = self._ended.get(rid)
        return None if ended is None else self._clock() - ended

    def move(self, rid: str, worker_id: str) -> None:
        """`rid` is held by `worker_id` now (re-routed)."""
        entry = self._entries[rid]
        self._per_worker[entry.worker_id] -= 1
        if not self._per_worker[entry.worker_id]:
            del self._per_worker[entry.worker_id]
        entry.worker_id = worker_id
        self._per_worker[worker_id] = self._per_worker.get(worker_id, 0) + 1

    def take_worker(self, worker_id: str) -> list[InflightEntry]:
        """Remove and return every request held by `worker_id` (it died or restarted)."""
        taken = self.held_by(worker_id)
        for entry in taken:
            self.remove(entry.rid)
        return taken

    def held_by(self, worker_id: str) -> list[InflightEntry]:
        return [entry for entry in self._entries.values() if entry.worker_id == worker_id]

    def get(self, rid: str) -> InflightEntry | None:
        return self._entries.get(rid)

    def count_on(self, worker_id: str) -> int:
        return self._per_worker.get(worker_id, 0)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[InflightEntry]:
        return iter(list(self._entries.values()))
