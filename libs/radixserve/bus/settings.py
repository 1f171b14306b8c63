"""Typed settings of one process's NATS connection.

settings = BusSettings.from_env(name="scheduler")   # RADIXSERVE_NATS_URL
settings = BusSettings(url="nats://127.0.0.1:4222", connect_attempts=3)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_NATS_URL = "RADIXSERVE_NATS_URL"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and how patient to be.

    The first connection is tried ``connect_attempts`` times, each attempt bounded by
    ``connect_timeout_s``, sleeping ``connect_backoff_s`` doubling up to
    ``connect_backoff_max_s`` between attempts. Once connected, the client
    reconnects forever, every ``reconnect_time_wait_s``, until closed.
    """

    url: str = DEFAULT_NATS_URL
    name: str = "radixserve"
    connect_timeout_s: float = 2.0
    connect_attempts: int = 5
    connect_backoff_s: float = 0.2
    connect_backoff_max_s: float = 2.0
    reconnect_time_wait_s: float = 0.25
    request_timeout_s: float = 5.0
    drain_timeout_s: float = 5.0
    ping_interval_s: int = 20

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("NATS url must not be empty")
        if self.connect_attempts < 1:
            raise ValueError(f"connect_attempts must be >= 1, got {self.connect_attempts}")
        for field in (
            "connect_timeout_s",
            "reconnect_time_wait_s",
            "request_timeout_s",
            "drain_timeout_s",
            "ping_interval_s",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.connect_backoff_s < 0 or self.connect_backoff_max_s < self.connect_backoff_s:
            raise ValueError("need 0 <= connect_backoff_s <= connect_backoff_max_s")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, name: str = "radixserve"
    ) -> BusSettings:
        """Settings with the URL from ``RADIXSERVE_NATS_URL`` (default nats://127.0.0.1:4222)."""
        env = os.environ if environ is None else environ
        return cls(url=env.get(ENV_NATS_URL, "").strip() or DEFAULT_NATS_URL, name=name)
