"""Typed settings of one process's NATS connection.

settings = BusSettings.from_env(name="scheduler")   # RADIXSERVE_NATS_URL, RADIXSERVE_NATS_*
settings = BusSettings(url="nats://127.0.0.1:4222", connect_attempts=3)
settings = BusSettings(url="tls://nats:4222", auth=NatsAuth(user="gateway", password=pw,
                                                            tls_ca="/etc/nats/ca.pem"))

Credentials are one of: user + password (also accepted as `user:password@` in the URL,
which is then taken out of it, so `url` is always safe to log), a `.creds` file (JWT +
nkey) or an nkey seed file. TLS: a CA file to verify the server, optionally a client
certificate and key. The password never shows in a repr.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.credentials import check_file, env_text, secret_from_env, split_userinfo

ENV_NATS_URL = "RADIXSERVE_NATS_URL"
ENV_NATS_USER = "RADIXSERVE_NATS_USER"
ENV_NATS_PASSWORD = "RADIXSERVE_NATS_PASSWORD"  # or RADIXSERVE_NATS_PASSWORD_FILE
ENV_NATS_CREDS_FILE = "RADIXSERVE_NATS_CREDS_FILE"
ENV_NATS_NKEY_SEED_FILE = "RADIXSERVE_NATS_NKEY_SEED_FILE"
ENV_NATS_TLS_CA = "RADIXSERVE_NATS_TLS_CA"
ENV_NATS_TLS_CERT = "RADIXSERVE_NATS_TLS_CERT"
ENV_NATS_TLS_KEY = "RADIXSERVE_NATS_TLS_KEY"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NO_CREDENTIALS = "no credentials"


@dataclass(frozen=True)
class NatsAuth:
    """Who this process is to NATS, and how it checks the server (TLS)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        ways = [self.user is not None, self.creds_file is not None, self.nkey_seed_file is not None]
        if sum(ways) > 1:
            raise ValueError("NATS: give one of user + password, a creds file or an nkey seed file")
        if (self.user is None) != (self.password is None):
            raise ValueError(
                f"NATS: a user needs a password and a password a user (${ENV_NATS_USER} with "
                f"${ENV_NATS_PASSWORD} or ${ENV_NATS_PASSWORD}_FILE)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"NATS: ${ENV_NATS_TLS_CERT} and ${ENV_NATS_TLS_KEY} go together")
        check_file(self.creds_file, f"NATS creds file (${ENV_NATS_CREDS_FILE})")
        check_file(self.nkey_seed_file, f"NATS nkey seed file (${ENV_NATS_NKEY_SEED_FILE})")
        check_file(self.tls_ca, f"NATS TLS CA (${ENV_NATS_TLS_CA})")
        check_file(self.tls_cert, f"NATS TLS certificate (${ENV_NATS_TLS_CERT})")
        check_file(self.tls_key, f"NATS TLS key (${ENV_NATS_TLS_KEY})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> NatsAuth:
        """From the `RADIXSERVE_NATS_*` variables; non-None `overrides` (flags) win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "user": env_text(env, ENV_NATS_USER),
            "password": secret_from_env(env, ENV_NATS_PASSWORD),
            "creds_file": env_text(env, ENV_NATS_CREDS_FILE),
            "nkey_seed_file": env_text(env, ENV_NATS_NKEY_SEED_FILE),
            "tls_ca": env_text(env, ENV_NATS_TLS_CA),
            "tls_cert": env_text(env, ENV_NATS_TLS_CERT),
            "tls_key": env_text(env, ENV_NATS_TLS_KEY),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_url(self, url: str) -> tuple[str, NatsAuth]:
        """(the URL without `user:password@`, these settings with that user): a URL's
        userinfo is accepted, but never kept where it could be logged."""
        bare, user, password = split_userinfo(url)
        if user is None and password is None:
            return url, self
        if self.user is not None or self.creds_file or self.nkey_seed_file:
            raise ValueError("NATS: credentials both in the URL and in the settings")
        return bare, replace(self, user=user, password=password)

    @property
    def identity(self) -> str:
        """Who connects, for messages: `user gateway`, `creds file ...`, `anonymous`."""
        if self.user is not None:
            return f"user {self.user!r}"
        if self.creds_file is not None:
            return f"the creds file {self.creds_file}"
        if self.nkey_seed_file is not None:
            return f"the nkey seed {self.nkey_seed_file}"
        return NO_CREDENTIALS

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context (None without TLS settings); a certificate or key that
        does not load is a ValueError naming the file."""
        if not self.uses_tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
        except ssl.SSLError as exc:
            raise ValueError(f"NATS TLS CA {self.tls_ca} does not load: {exc}") from None
        if self.tls_cert is not None:
            try:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"NATS TLS certificate {self.tls_cert} / key {self.tls_key} do not load: {exc}"
                ) from None
        return context

    def connect_options(self) -> dict[str, Any]:
        """nats-py `connect()` keyword arguments for these credentials and TLS."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options.update(user=self.user, password=self.password)
        if self.creds_file is not None:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = self.nkey_seed_file
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        return options


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and how patient to be.

    The first connection is tried ``connect_attempts`` times, each attempt bounded by
    ``connect_timeout_s``, sleeping ``connect_backoff_s`` doubling up to
    ``connect_backoff_max_s`` between attempts; a refusal of the credentials ends it at
    once. Once connected, the client reconnects forever, every
    ``reconnect_time_wait_s``, until closed.
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
    auth: NatsAuth = field(default_factory=NatsAuth)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("NATS url must not be empty")
        url, auth = self.auth.with_url(self.url)
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "auth", auth)
        if self.connect_attempts < 1:
            raise ValueError(f"connect_attempts must be >= 1, got {self.connect_attempts}")
        for name in (
            "connect_timeout_s",
            "reconnect_time_wait_s",
            "request_timeout_s",
            "drain_timeout_s",
            "ping_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.connect_backoff_s < 0 or self.connect_backoff_max_s < self.connect_backoff_s:
            raise ValueError("need 0 <= connect_backoff_s <= connect_backoff_max_s")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, name: str = "radixserve"
    ) -> BusSettings:
        """Settings with the URL from ``RADIXSERVE_NATS_URL`` (default nats://127.0.0.1:4222)
        and the credentials and TLS from the other ``RADIXSERVE_NATS_*`` variables."""
        env = os.environ if environ is None else environ
        return cls(
            url=env_text(env, ENV_NATS_URL) or DEFAULT_NATS_URL,
            name=name,
            auth=NatsAuth.from_env(env),
        )
