"""What the gateway knows about workers and services: who is ready (for /health) and the
workers' load (metrics).

    tracker = WorkerTracker(metrics, timeout_s=5.0)
    await bus.subscribe(subjects.heartbeat_all, tracker.on_heartbeat)
    await bus.subscribe(subjects.stats_all, tracker.on_stats)
    await bus.subscribe(subjects.alive_all, tracker.on_alive)
    tracker.ready_count()        # workers whose last heartbeat said ready, recently
    tracker.services()           # {"tokenizer": 2, ...}: instances heard from recently, ready
    tracker.missing()            # ["worker"]: what this gateway still needs to serve

Routing is the scheduler's; this is only a view, kept from the same messages.
"""

from __future__ import annotations

import logging
import time

from radixserve.bus import BusMsg
from radixserve.protocol import (
    Heartbeat,
    ServiceHeartbeat,
    WorkerStats,
    WorkerStatus,
)
from radixserve.services.health import SERVICES
from radixserve.services.messages import decode_or_drop
from radixserve.telemetry import GatewayMetrics

log = logging.getLogger(__name__)

# What a request may pass through. The grammar service too: a structured request sent
# while it still loads (tens of seconds) would fail at once with grammar_unavailable.
SERVING_PATH = ("tokenizer", "scheduler", "grammar", "detokenizer")


class WorkerTracker:
    def __init__(self, metrics: GatewayMetrics, timeout_s: float) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        # worker id -> (monotonic time of its last heartbeat, its status then)
        self._heartbeats: dict[str, tuple[float, WorkerStatus]] = {}
        self._stats_seen: dict[str, float] = {}  # worker id -> monotonic time of its stats
        # (service, instance id) -> (monotonic time of its last ServiceHeartbeat, status)
        self._alive: dict[tuple[str, str], tuple[float, str]] = {}

    async def on_heartbeat(self, msg: BusMsg) -> None:
        beat = decode_or_drop(msg, Heartbeat, log)
        if beat is None:
            return
        self._heartbeats[beat.worker_id] = (time.monotonic(), beat.status)

    async def on_alive(self, msg: BusMsg) -> None:
        beat = decode_or_drop(msg, ServiceHeartbeat, log)
        if beat is None:
            return
        self._alive[beat.service, beat.instance_id] = (time.monotonic(), beat.status)

    def services(self) -> dict[str, int]:
        """Instances of each service whose last heartbeat, within the timeout, said ready."""
        cutoff = time.monotonic() - self.timeout_s
        counts = dict.fromkeys(SERVICES, 0)
        for (service, _), (seen, status) in self._alive.items():
            if seen >= cutoff and status == "ready":
                counts[service] = counts.get(service, 0) + 1
        return counts

    async def on_stats(self, msg: BusMsg) -> None:
        stats = decode_or_drop(msg, WorkerStats, log)
        if stats is None:
            return
        self._stats_seen[stats.worker_id] = time.monotonic()
        self.metrics.observe_worker_stats(stats)

    def ready_count(self) -> int:
        cutoff = time.monotonic() - self.timeout_s
        return sum(
            1
            for seen, status in self._heartbeats.values()
            if seen >= cutoff and status == WorkerStatus.READY
        )

    def missing(self) -> list[str]:
        """The services of a request's path with no ready instance heard recently, then
        "worker" when no worker is ready: empty once this gateway can serve."""
        counts = self.services()
        gaps = [name for name in SERVING_PATH if not counts.get(name)]
        return gaps if self.ready_count() else [*gaps, "worker"]

    def prune(self) -> None:
        """Forget workers silent for a while (their gauges too), e.g. before a scrape."""
        cutoff = time.monotonic() - 3 * self.timeout_s
        for worker, seen in list(self._stats_seen.items()):
            if seen < cutoff:
                del self._stats_seen[worker]
                self.metrics.forget_worker(worker)
        for worker, (seen, _) in list(self._heartbeats.items()):
            if seen < cutoff:
                del self._heartbeats[worker]
        for instance, (seen, _) in list(self._alive.items()):
            if seen < cutoff:
                del self._alive[instance]
