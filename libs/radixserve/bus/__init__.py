"""NATS bus: connect with retry, reconnect forever, pub/sub, queue groups,
request/reply with timeouts, W3C trace context in headers, health.

    from radixserve.bus import Bus, BusSettings
    bus = await Bus.connect(BusSettings.from_env(name="gateway"))

See ``radixserve.bus.client`` for the full usage.
"""

from __future__ import annotations

from radixserve.bus.client import Bus, BusHealth, BusSubscription, Handler
from radixserve.bus.errors import (
    BusAuthError,
    BusClosed,
    BusConnectError,
    BusError,
    BusNoResponders,
    BusPayloadTooLarge,
    BusTimeout,
)
from radixserve.bus.message import BusMsg
from radixserve.bus.settings import BusSettings, NatsAuth
from radixserve.bus.tracing import TRACEPARENT, extract_trace, inject_trace

__all__ = [
    "TRACEPARENT",
    "Bus",
    "BusAuthError",
    "BusClosed",
    "BusConnectError",
    "BusError",
    "BusHealth",
    "BusMsg",
    "BusNoResponders",
    "BusPayloadTooLarge",
    "BusSettings",
    "BusSubscription",
    "BusTimeout",
    "Handler",
    "NatsAuth",
    "extract_trace",
    "inject_trace",
]
