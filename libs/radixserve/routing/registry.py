"""`WorkerRegistry`: the workers the scheduler knows, from their heartbeats and stats.

Liveness is judged by when a heartbeat *arrived* (the scheduler's monotonic clock),
never by the time the worker wrote in it: hosts' clocks disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.protocol import Heartbeat, WorkerStats, WorkerStatus


@dataclass
class WorkerState:
    """What is known of one worker; `load` is what routing compares."""

    worker_id: str
    last_seen: float  # monotonic: the last heartbeat's arrival (or first stats, before one)
    heartbeat: Heartbeat | None = None
    stats: WorkerStats | None = None
    # Requests routed here since `stats` was reported: the report cannot count them yet.
    routed_since_stats: int = 0

    @property
    def ready(self) -> bool:
        """Takes new work: a heartbeat said `ready` (not starting, draining or stopping)."""
        return self.heartbeat is not None and self.heartbeat.status == WorkerStatus.READY

    @property
    def load(self) -> int:
        reported = 0
        if self.stats is not None:
            reported = self.stats.num_running_reqs + self.stats.num_queue_reqs
        return reported + self.routed_since_stats


class WorkerRegistry:
    """Workers by id; one missing heartbeats for `timeout_s` is dropped by `expire`."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"worker timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._workers: dict[str, WorkerState] = {}

    def on_heartbeat(self, beat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the worker restarted (a new `epoch`), which
        means whatever it held before is gone."""
        state = self._workers.get(beat.worker_id)
        if state is None:
            self._workers[beat.worker_id] = WorkerState(beat.worker_id, now, heartbeat=beat)
            return False
        restarted = state.heartbeat is not None and state.heartbeat.epoch != beat.epoch
        if restarted:
            state.stats = None  # the old process's load
            state.routed_since_stats = 0
        state.heartbeat = beat
        state.last_seen = now
        return restarted

    def on_stats(self, stats: WorkerStats, now: float) -> None:
        state = self._workers.get(stats.worker_id)
        if state is None:
            # Stats and heartbeats travel on different subscriptions, so stats may come
            # first; the worker is not routable until its heartbeat says ready.
            self._workers[stats.worker_id] = WorkerState(stats.worker_id, now, stats=stats)
            return
        if state.stats is not None and stats.time < state.stats.time:
            return  # an older report overtaken by a newer one
        state.stats = stats
        state.routed_since_stats = 0

    def note_routed(self, worker_id: str) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.routed_since_stats += 1

    def expire(self, now: float) -> list[str]:
        """Drop the workers not heard from for `timeout_s`; their ids."""
        dead = [w for w, s in self._workers.items() if now - s.last_seen > self.timeout_s]
        for worker_id in dead:
            del self._workers[worker_id]
        return dead

    def ready(self) -> list[WorkerState]:
        return [state for state in self._workers.values() if state.ready]

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)
