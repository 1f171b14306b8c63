"""Which services are alive: listen to their heartbeats for a moment.

Every service instance publishes a `ServiceHeartbeat` on `{p}.alive.{service}.{id}`
every second, and each worker a `Heartbeat` with its status. `radixserve health` and
`radixserve up` read them here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from radixserve import protocol
from radixserve.bus import Bus, BusMsg, BusSettings
from radixserve.services.messages import decode_or_drop

log = logging.getLogger(__name__)

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer")


@dataclass
class HealthReport:
    services: dict[str, dict[str, protocol.ServiceHeartbeat]] = field(default_factory=dict)
    workers: dict[str, protocol.Heartbeat] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [name for name in SERVICES if not self.services.get(name)]

    @property
    def ready_workers(self) -> list[str]:
        return [
            wid for wid, beat in self.workers.items() if beat.status is protocol.WorkerStatus.READY
        ]

    @property
    def healthy(self) -> bool:
        return not self.missing() and bool(self.ready_workers)

    def render(self) -> str:
        lines = []
        for name in SERVICES:
            instances = self.services.get(name, {})
            if not instances:
                lines.append(f"{name:<12} DOWN")
                continue
            for beat in instances.values():
                lines.append(f"{name:<12} {beat.status:<9} {beat.instance_id} (pid {beat.pid})")
        for wid, worker in self.workers.items():
            lines.append(
                f"{'engine':<12} {worker.status.value:<9} {wid}: "
                f"{worker.capacity.max_total_num_tokens} KV tokens, {worker.model}"
            )
        return "\n".join(lines)


async def probe(settings: BusSettings, prefix: str, wait_s: float = 2.5) -> HealthReport:
    """Heartbeats heard within `wait_s` (a bit over two heartbeat periods by default),
    connected as `settings` say (its URL, credentials and TLS)."""
    report = HealthReport()
    subjects = protocol.Subjects(prefix)
    bus = await Bus.connect(
        dataclasses.replace(settings, name="radixserve-health", connect_attempts=2)
    )
    try:

        async def on_alive(msg: BusMsg) -> None:
            beat = decode_or_drop(msg, protocol.ServiceHeartbeat, log)
            if beat is None:
                return
            report.services.setdefault(beat.service, {})[beat.instance_id] = beat

        async def on_worker(msg: BusMsg) -> None:
            beat = decode_or_drop(msg, protocol.Heartbeat, log)
            if beat is None:
                return
            report.workers[beat.worker_id] = beat

        await bus.subscribe(subjects.alive_all, on_alive)
        await bus.subscribe(subjects.heartbeat_all, on_worker)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        await bus.close()
    return report
