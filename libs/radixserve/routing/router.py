"""The routing decision: which ready worker gets a request.

`Router` is the seam. `LeastLoadRouter` compares reported load only;
`CacheAwareRouter` also looks up the prompt in `KvMirrors` (the scheduler's copies of
each worker's radix cache), trades the cached prefix it finds against load, and fills
`expected_cached_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.protocol import TokenizedRequest, unpack_tokens_array
from radixserve.routing.kv_mirror import KvMirrors, PromptHashes

# A prefix in a worker's host memory against one on another's device: the copy back is
# far cheaper than a prefill, yet not free.
HOST_HIT_WEIGHT = 0.5


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


class CacheAwareRouter:
    """SGLang's cache-aware policy over `KvMirrors`.

    While loads are balanced, the worker caching the longest prefix of the prompt
    (ties: lower load, fewer in flight, lower id) gets it, if that prefix covers at
    least `cache_threshold` of the prompt; otherwise the least loaded worker does.
    Loads are imbalanced when the busiest worker's exceeds the idlest's by more than
    `balance_abs_threshold` and by more than `balance_rel_threshold` times: then the
    least loaded worker gets it, whatever it caches, since reuse would not pay for the
    queueing. `expected_cached_tokens` is always the mirror's match on the chosen worker.
    """

    def __init__(
        self,
        mirrors: KvMirrors,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.mirrors = mirrors
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._least_load = LeastLoadRouter()

    def pick(self, request: TokenizedRequest, workers: Sequence[WorkerLoad]) -> Route | None:
        least = self._least_load.pick(request, workers)
        if least is None:
            return None
        prompt = PromptHashes(unpack_tokens_array(request.input_ids))
        route = self._choose(prompt, workers, least)
        self.mirrors.note_routed(route.worker_id, prompt)
        return route

    def _choose(self, prompt: PromptHashes, workers: Sequence[WorkerLoad], least: Route) -> Route:
        if self._imbalanced(workers):
            return Route(least.worker_id, self.mirrors.matched_tokens(least.worker_id, prompt))
        matched = {w.worker_id: self.mirrors.matched_tokens(w.worker_id, prompt) for w in workers}
        score = {w: self._score(w, prompt, matched[w]) for w in matched}
        best = min(workers, key=lambda w: (-score[w.worker_id], w.load, w.inflight, w.worker_id))
        hit = matched[best.worker_id]
        if hit > 0 and hit >= self.cache_threshold * prompt.num_tokens:
            return Route(best.worker_id, hit)
        return Route(least.worker_id, matched[least.worker_id])

    def _score(self, worker_id: str, prompt: PromptHashes, matched: int) -> float:
        """What a worker's match is worth: a token in its host memory (HiCache) costs a
        copy back, so it counts HOST_HIT_WEIGHT of one on the device."""
        if not matched:
            return 0.0
        device = self.mirrors.matched_device_tokens(worker_id, prompt)
        return device + HOST_HIT_WEIGHT * (matched - device)

    def _imbalanced(self, workers: Sequence[WorkerLoad]) -> bool:
        loads = [w.load for w in workers]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low
