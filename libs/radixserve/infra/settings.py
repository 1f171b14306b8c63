"""Typed settings for the local NATS + Redis launcher.

Build them once per process, from flags or from the environment:

    settings = InfraSettings.from_env()            # RADIXSERVE_* variables
    settings = InfraSettings(nats_port=4222)       # explicit

A configured URL (``nats_url`` / ``redis_url``) means "use that server": the
launcher then starts nothing for it. A port of ``None`` (or 0) means "pick a free one".
With ``auth`` (the default; ``RADIXSERVE_INFRA_AUTH=0`` or ``--no-auth`` turns it off)
the servers it starts take only generated credentials: a NATS user per role, allowed
its subjects under ``subject_prefix``, and one Redis ACL user.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from radixserve.protocol.subjects import DEFAULT_PREFIX, check_prefix

ENV_NATS_URL = "RADIXSERVE_NATS_URL"
ENV_REDIS_URL = "RADIXSERVE_REDIS_URL"
ENV_NATS_PORT = "RADIXSERVE_NATS_PORT"
ENV_REDIS_PORT = "RADIXSERVE_REDIS_PORT"
ENV_HOST = "RADIXSERVE_INFRA_HOST"
ENV_NATS_BIN = "RADIXSERVE_NATS_SERVER_BIN"
ENV_REDIS_BIN = "RADIXSERVE_REDIS_SERVER_BIN"
ENV_AUTH = "RADIXSERVE_INFRA_AUTH"


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
    auth: bool = True
    subject_prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for name in ("nats_port", "redis_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("startup_timeout_s and stop_timeout_s must be > 0")
        if not self.host:
            raise ValueError("host must not be empty")
        check_prefix(self.subject_prefix)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InfraSettings:
        """Read ``RADIXSERVE_NATS_URL``, ``RADIXSERVE_REDIS_URL``, ``RADIXSERVE_NATS_PORT``,
        ``RADIXSERVE_REDIS_PORT``, ``RADIXSERVE_INFRA_HOST``, ``RADIXSERVE_NATS_SERVER_BIN``,
        ``RADIXSERVE_REDIS_SERVER_BIN`` and ``RADIXSERVE_INFRA_AUTH`` (1/0); unset or empty
        means the default."""
        env = os.environ if environ is None else environ
        return cls(
            nats_url=_text(env, ENV_NATS_URL),
            redis_url=_text(env, ENV_REDIS_URL),
            nats_port=_port(env, ENV_NATS_PORT),
            redis_port=_port(env, ENV_REDIS_PORT),
            host=_text(env, ENV_HOST) or "127.0.0.1",
            nats_server_path=_text(env, ENV_NATS_BIN),
            redis_server_path=_text(env, ENV_REDIS_BIN),
            auth=_flag(env, ENV_AUTH, default=True),
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


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    value = (_text(env, name) or "").lower()
    if not value:
        return default
    if value not in ("1", "0", "true", "false", "on", "off"):
        raise ValueError(f"{name} must be 1 or 0, got {value!r}")
    return value in ("1", "true", "on")
