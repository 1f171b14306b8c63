"""Typed settings for the local NATS + Redis launcher.

Build them once per process, from flags or from the environment:

    settings = InfraSettings.from_env()            # RADIXSERVE_* variables
    settings = InfraSettings(nats_port=4222)       # explicit

A configured URL (``nats_url`` / ``redis_url``) means "use that server": the
launcher then starts nothing for it. A port of ``None`` (or 0) means "pick a free one".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_NATS_URL = "RADIXSERVE_NATS_URL"
ENV_REDIS_URL = "RADIXSERVE_REDIS_URL"
ENV_NATS_PORT = "RADIXSERVE_NATS_PORT"
ENV_REDIS_PORT = "RADIXSERVE_REDIS_PORT"
ENV_HOST = "RADIXSERVE_INFRA_HOST"
ENV_NATS_BIN = "RADIXSERVE_NATS_SERVER_BIN"
ENV_REDIS_BIN = "RADIXSERVE_REDIS_SERVER_BIN"


@dataclass(frozen=True)
class InfraSettings:
    """Where NATS and Redis live, or how to start them locally."""

    nats_url: str | None = None
    redis_url: str | None = None
    nats_port: int | None = None
    redis_port: int | None = None
    host: str = "127.0.0.1"
    nats_server_path: str | None = None
    redis_server_path: str | None = None
    startup_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("nats_port", "redis_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("startup_timeout_s and stop_timeout_s must be > 0")
        if not self.host:
            raise ValueError("host must not be empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InfraSettings:
        """Read ``RADIXSERVE_NATS_URL``, ``RADIXSERVE_REDIS_URL``, ``RADIXSERVE_NATS_PORT``,
        ``RADIXSERVE_REDIS_PORT``, ``RADIXSERVE_INFRA_HOST``, ``RADIXSERVE_NATS_SERVER_BIN``
        and ``RADIXSERVE_REDIS_SERVER_BIN``; unset or empty means the default."""
        env = os.environ if environ is None else environ
        return cls(
            nats_url=_text(env, ENV_NATS_URL),
            redis_url=_text(env, ENV_REDIS_URL),
            nats_port=_port(env, ENV_NATS_PORT),
            redis_port=_port(env, ENV_REDIS_PORT),
            host=_text(env, ENV_HOST) or "127.0.0.1",
            nats_server_path=_text(env, ENV_NATS_BIN),
            redis_server_path=_text(env, ENV_REDIS_BIN),
        )


def _text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _port(env: Mapping[str, str], name: str) -> int | None:
    value = _text(env, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer port, got {value!r}") from None
