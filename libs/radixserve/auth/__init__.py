"""API keys: who is calling, what they may do, how much.

    settings = auth.settings_from(ns, os.environ)     # AuthSettings (off, file, Redis)
    checker = Authenticator(KeyFile(path), RedisKeys(store))
    key = await checker.check(presented_key(headers)) # ApiKey | ApiError 401 / 503
    headers = await KeyRateLimiter(store).admit(key)  # x-ratelimit-*; 429 over a limit

The gateway applies them (services/gateway/auth.py); `radixserve keys` manages them.
"""

from radixserve.auth.authenticator import Authenticator, presented_key
from radixserve.auth.keyfile import KeyFile, KeyFileError, read_keys, write_keys
from radixserve.auth.keys import (
    PRIORITY_CLASSES,
    SCOPES,
    ApiKey,
    Scope,
    generate_key,
    hash_key,
    parse_scopes,
)
from radixserve.auth.rate_limits import KeyRateLimiter, RateLimited
from radixserve.auth.redis_keys import KeyExists, RedisKeys
from radixserve.auth.settings import AuthSettings

__all__ = [
    "PRIORITY_CLASSES",
    "SCOPES",
    "ApiKey",
    "AuthSettings",
    "Authenticator",
    "KeyExists",
    "KeyFile",
    "KeyFileError",
    "KeyRateLimiter",
    "RateLimited",
    "RedisKeys",
    "Scope",
    "generate_key",
    "hash_key",
    "parse_scopes",
    "presented_key",
    "read_keys",
    "write_keys",
]
