"""Typed settings of one process's Redis connection.

settings = StoreSettings.from_env()     # RADIXSERVE_REDIS_URL, RADIXSERVE_REDIS_PREFIX, ..._USER
settings = StoreSettings(url="redis://127.0.0.1:6379/0", key_prefix="test:")
settings = StoreSettings(url="rediss://redis:6380/0", auth=RedisAuth(user="radixserve",
                                                                     password=pw, tls_ca=ca))

Credentials are an ACL user + password (or a password alone, for the `default` user);
`user:password@` in the URL is accepted and taken out of it, so `url` is always safe to
log. TLS is on for a `rediss://` URL or when a CA / client certificate is given. The
password never shows in a repr.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.credentials import check_file, env_text, secret_from_env, split_userinfo

ENV_REDIS_URL = "RADIXSERVE_REDIS_URL"
ENV_REDIS_PREFIX = "RADIXSERVE_REDIS_PREFIX"
ENV_REDIS_USER = "RADIXSERVE_REDIS_USER"
ENV_REDIS_PASSWORD = "RADIXSERVE_REDIS_PASSWORD"  # or RADIXSERVE_REDIS_PASSWORD_FILE
ENV_REDIS_TLS_CA = "RADIXSERVE_REDIS_TLS_CA"
ENV_REDIS_TLS_CERT = "RADIXSERVE_REDIS_TLS_CERT"
ENV_REDIS_TLS_KEY = "RADIXSERVE_REDIS_TLS_KEY"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "radixserve:"


@dataclass(frozen=True)
class RedisAuth:
    """Who this process is to Redis, and how it checks the server (TLS)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.user is not None and self.password is None:
            raise ValueError(
                f"Redis: the user {self.user!r} needs a password (${ENV_REDIS_PASSWORD} "
                f"or ${ENV_REDIS_PASSWORD}_FILE)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"Redis: ${ENV_REDIS_TLS_CERT} and ${ENV_REDIS_TLS_KEY} go together")
        check_file(self.tls_ca, f"Redis TLS CA (${ENV_REDIS_TLS_CA})")
        check_file(self.tls_cert, f"Redis TLS certificate (${ENV_REDIS_TLS_CERT})")
        check_file(self.tls_key, f"Redis TLS key (${ENV_REDIS_TLS_KEY})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RedisAuth:
        """From the `RADIXSERVE_REDIS_*` variables; non-None `overrides` (flags) win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "user": env_text(env, ENV_REDIS_USER),
            "password": secret_from_env(env, ENV_REDIS_PASSWORD),
            "tls_ca": env_text(env, ENV_REDIS_TLS_CA),
            "tls_cert": env_text(env, ENV_REDIS_TLS_CERT),
            "tls_key": env_text(env, ENV_REDIS_TLS_KEY),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_url(self, url: str) -> tuple[str, RedisAuth]:
        """(the URL without `user:password@`, these settings with those credentials)."""
        bare, user, password = split_userinfo(url)
        if user is None and password is None:
            return url, self
        if self.user is not None or self.password is not None:
            raise ValueError("Redis: credentials both in the URL and in the settings")
        return bare, replace(self, user=user, password=password)

    @property
    def identity(self) -> str:
        if self.user is not None:
            return f"user {self.user!r}"
        return "the default user" if self.password is not None else "no credentials"

    def client_options(self, url: str) -> dict[str, Any]:
        """redis-py `from_url` keyword arguments for these credentials and TLS."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options.update(username=self.user, password=self.password)
        if self.tls_ca is not None or self.tls_cert is not None or url.startswith("rediss://"):
            from redis.asyncio.connection import SSLConnection

            # NOTE: from_url lets the URL's options win over these, but not the class.
            options.update(
                connection_class=SSLConnection,
                ssl_ca_certs=self.tls_ca,
                ssl_certfile=self.tls_cert,
                ssl_keyfile=self.tls_key,
            )
        return options


@dataclass(frozen=True)
class StoreSettings:
    """How to reach Redis. ``connect_attempts`` PINGs, each bounded by
    ``connect_timeout_s``, with doubling backoff, before Store.connect gives up (at once
    when Redis refuses the credentials)."""

    url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_PREFIX
    connect_timeout_s: float = 2.0
    socket_timeout_s: float = 5.0
    connect_attempts: int = 5
    connect_backoff_s: float = 0.2
    connect_backoff_max_s: float = 2.0
    auth: RedisAuth = field(default_factory=RedisAuth)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("Redis url must not be empty")
        url, auth = self.auth.with_url(self.url)
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "auth", auth)
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
            url=env_text(env, ENV_REDIS_URL) or DEFAULT_REDIS_URL,
            key_prefix=env.get(ENV_REDIS_PREFIX, DEFAULT_PREFIX),
            auth=RedisAuth.from_env(env),
        )

    def client_options(self) -> dict[str, Any]:
        """redis-py `from_url(self.url, ...)` keyword arguments: timeouts, credentials, TLS."""
        return {
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.socket_timeout_s,
            **self.auth.client_options(self.url),
        }
