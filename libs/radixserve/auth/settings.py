"""How the gateway checks callers: flags first, then `RADIXSERVE_*` variables, then defaults.

Auth is on when a keys file is given or `--require-api-key` is set; the keys file and
Redis (keys made by `radixserve keys create`) are both consulted then. With auth off,
the gateway serves only a loopback address unless `--allow-unauthenticated` says so.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_API_KEYS_FILE = "RADIXSERVE_API_KEYS_FILE"
ENV_REQUIRE_API_KEY = "RADIXSERVE_REQUIRE_API_KEY"
ENV_ALLOW_UNAUTHENTICATED = "RADIXSERVE_ALLOW_UNAUTHENTICATED"
ENV_API_KEY_CACHE_S = "RADIXSERVE_API_KEY_CACHE_S"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class AuthSettings:
    keys_file: Path | None = None
    require_api_key: bool = False
    allow_unauthenticated: bool = False
    # How long a Redis answer about a key is trusted (a revoked key works this long).
    cache_ttl_s: float = 5.0
    # How long a cached answer stands in while Redis does not answer.
    stale_s: float = 60.0
    lookup_timeout_s: float = 1.0
    # How often the keys file is checked for a change.
    reload_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("cache_ttl_s", "stale_s", "lookup_timeout_s", "reload_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.stale_s < self.cache_ttl_s:
            raise ValueError("stale_s must be >= cache_ttl_s")

    @property
    def enabled(self) -> bool:
        return self.keys_file is not None or self.require_api_key

    def check_exposure(self, host: str) -> None:
        """Refuse to serve without keys on an address other machines reach."""
        if self.enabled or self.allow_unauthenticated or is_loopback(host):
            return
        raise ValueError(
            f"refusing to serve {host} without API keys: anyone who reaches it could use "
            f"and flush the server. Give --api-keys-file (${ENV_API_KEYS_FILE}) or "
            f"--require-api-key with keys from `radixserve keys create`, or bind "
            f"127.0.0.1, or pass --allow-unauthenticated (${ENV_ALLOW_UNAUTHENTICATED}=true) "
            "if something in front of it checks callers"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help=f"JSON file of hashed API keys (`radixserve keys create --file`), reloaded on "
        f"change; turns auth on; default ${ENV_API_KEYS_FILE}",
    )
    parser.add_argument(
        "--require-api-key",
        action="store_true",
        default=None,
        help=f"turn auth on with the keys in Redis only; default ${ENV_REQUIRE_API_KEY}",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve a non-loopback address without API keys (something in front checks "
        f"callers); default ${ENV_ALLOW_UNAUTHENTICATED}",
    )
    parser.add_argument(
        "--api-key-cache-s",
        type=float,
        default=None,
        help="how long a key checked in Redis is trusted, so a revoked key stops working "
        f"within it; default ${ENV_API_KEY_CACHE_S} or 5",
    )


def gateway_argv(settings: AuthSettings) -> list[str]:
    """The gateway flags that give it `settings` (what `radixserve up` passes on)."""
    argv = [] if settings.keys_file is None else ["--api-keys-file", str(settings.keys_file)]
    if settings.require_api_key:
        argv.append("--require-api-key")
    if settings.allow_unauthenticated:
        argv.append("--allow-unauthenticated")
    return [*argv, "--api-key-cache-s", str(settings.cache_ttl_s)]


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"${name} must be true or false, got {value!r}")


def settings_from(ns: argparse.Namespace, env: Mapping[str, str]) -> AuthSettings:
    keys_file = ns.api_keys_file or (
        Path(v) if (v := env.get(ENV_API_KEYS_FILE, "").strip()) else None
    )
    require = ns.require_api_key or _flag(env, ENV_REQUIRE_API_KEY)
    allow = ns.allow_unauthenticated or _flag(env, ENV_ALLOW_UNAUTHENTICATED)
    cache = ns.api_key_cache_s
    if cache is None and (raw := env.get(ENV_API_KEY_CACHE_S, "").strip()):
        try:
            cache = float(raw)
        except ValueError:
            raise ValueError(f"${ENV_API_KEY_CACHE_S} must be seconds, got {raw!r}") from None
    defaults = AuthSettings()
    cache_ttl = defaults.cache_ttl_s if cache is None else cache
    return AuthSettings(
        keys_file=keys_file,
        require_api_key=bool(require),
        allow_unauthenticated=bool(allow),
        cache_ttl_s=cache_ttl,
        stale_s=max(defaults.stale_s, cache_ttl),
    )
