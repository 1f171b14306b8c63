"""Typed settings of one process's Redis connection.

settings = StoreSettings.from_env()     # RADIXSERVE_REDIS_URL, RADIXSERVE_REDIS_PREFIX
settings = StoreSettings(url="redis://127.0.0.1:6379/0", key_prefix="test:")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_REDIS_URL = "RADIXSERVE_REDIS_URL"
ENV_REDIS_PREFIX = "RADIXSERVE_REDIS_PREFIX"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "radixserve:"


@dataclass(frozen=True)
class StoreSettings:
    """How to reach Redis. ``connect_attempts`` PINGs, each bounded by
    ``connect_timeout_s``, with doubling backoff, before Store.connect gives up."""

    url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_PREFIX
    connect_timeout_s: float = 2.0
    socket_timeout_s: float = 5.0
    connect_attempts: int = 5
    connect_backoff_s: float = 0.2
    connect_backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("Redis url must not be empty")
        if self.connect_attempts < 1:
            raise ValueError(f"connect_attempts must be >= 1, got {self.connect_attempts}")
        if self.connect_timeout_s <= 0 or self.socket_timeout_s <= 0:
            raise ValueError("connect_timeout_s and socket_timeout_s must be > 0")
        if self.connect_backoff_s < 0 or self.connect_backoff_max_s < self.connect_backoff_s:
            raise ValueError("need 0 <= connect_backoff_s <= connect_backoff_max_s")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreSettings:
        env = os.environ if environ is None else environ
        return cls(
            url=env.get(ENV_REDIS_URL, "").strip() or DEFAULT_REDIS_URL,
            key_prefix=env.get(ENV_REDIS_PREFIX, DEFAULT_PREFIX),
        )
