"""What every HTTP handler of one gateway shares: settings, bus, hub, records, metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.api import ApiError, Assembly
from radixserve.auth import Authenticator, KeyFile, KeyRateLimiter
from radixserve.bus import Bus
from radixserve.protocol import Subjects
from radixserve.services.gateway.aborts import AbortSender
from radixserve.services.gateway.hub import Hub
from radixserve.services.gateway.records import RecordWriter
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.workers import WorkerTracker
from radixserve.telemetry import GatewayMetrics


@dataclass
class Guard:
    """The gateway's API-key checks (auth on): who calls, and their rate limits."""

    authenticator: Authenticator
    limiter: KeyRateLimiter
    keyfile: KeyFile | None


class Run(Protocol):
    """What the shared state knows of a request in flight (`inflight.Inflight`): what the
    lost-request check (`lost.py`) asks of it."""

    assembly: Assembly

    @property
    def rid(self) -> str: ...
    def silent_since(self) -> float | None: ...
    def report_lost(self) -> None: ...


@dataclass
class GatewayState:
    settings: GatewaySettings
    bus: Bus
    hub: Hub
    aborts: AbortSender
    records: RecordWriter
    metrics: GatewayMetrics
    workers: WorkerTracker
    # None: auth off (a loopback gateway, or --allow-unauthenticated).
    guard: Guard | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Set on SIGTERM: new requests get 503 while the ones in flight finish.
    draining: bool = False
    inflight: set[Run] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def subjects(self) -> Subjects:
        return self.settings.service.subjects

    @property
    def gateway_id(self) -> str:
        return self.settings.gateway_id

    def check_accepting(self) -> None:
        """Raise the 503 a new generation request gets while draining or off the bus."""
        if self.draining:
            raise ApiError.unavailable("the gateway is shutting down", code="draining")
        if not self.bus.is_connected:
            raise ApiError.unavailable("the gateway is not connected to NATS", code="no_bus")

    def missing(self) -> list[str]:
        """Why this gateway cannot serve now ("draining", "nats", then the services and
        "worker" not heard from); empty when it can."""
        if self.draining:
            return ["draining"]
        if not self.bus.is_connected:
            return ["nats"]
        return self.workers.missing()

    def add_inflight(self, run: Run) -> None:
        self.inflight.add(run)
        self._idle.clear()

    def remove_inflight(self, run: Run) -> None:
        self.inflight.discard(run)
        if not self.inflight:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
