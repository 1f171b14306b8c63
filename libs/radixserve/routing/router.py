"""The routing decision: which ready worker gets a request.

`Router` is the seam: `LeastLoadRouter` compares reported load only; the cache-aware
router (KV-event mirrors of each worker's radix tree) implements the same `pick`,
trading the cached prefix length it finds against load, and fills
`expected_cached_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.protocol import TokenizedRequest


@dataclass(frozen=True)
class WorkerLoad:
    """One ready worker as a router sees it."""

    worker_id: str
    load: int  # running + queued as last reported, plus what was routed there since
    inflight: int  # this scheduler's unfinished requests on it


@dataclass(frozen=True)
class Route:
    worker_id: str
    expected_cached_tokens: int = 0  # the prefix the router expects the worker to have


class Router(Protocol):
    def pick(self, request: TokenizedRequest, workers: Sequence[WorkerLoad]) -> Route | None:
        """The worker for `request` among `workers` (all ready); None when empty."""
        ...


class LeastLoadRouter:
    """The least loaded worker; ties go to the fewest in flight, then the lowest id
    (so a decision is reproducible)."""

    def pick(self, request: TokenizedRequest, workers: Sequence[WorkerLoad]) -> Route | None:
        del request  # load only; the prompt matters to the cache-aware router
        if not workers:
            return None
        best = min(workers, key=lambda w: (w.load, w.inflight, w.worker_id))
        return Route(best.worker_id)
