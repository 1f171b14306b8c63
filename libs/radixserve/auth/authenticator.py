"""Who is calling: the presented key checked against the keys file, then Redis.

    auth = Authenticator(keyfile, RedisKeys(store))
    key = await auth.check(presented_key(headers))    # ApiKey, or ApiError 401 / 503

A Redis answer (a key, or no such key) is kept `cache_ttl_s`, so a client's requests
cost Redis at most one lookup per key per interval, and a revoked key stops working
within it. While Redis does not answer, a cached answer is used up to `stale_s` old;
past that a key Redis must vouch for gets 503. Concurrent checks of one key share
one lookup. Keys are compared by their hash, and never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from redis.exceptions import RedisError

from radixserve.api import ApiError
from radixserve.auth.keyfile import KeyFile
from radixserve.auth.keys import MAX_KEY_CHARS, ApiKey, hash_key
from radixserve.auth.redis_keys import RedisKeys

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 10_000


def presented_key(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer <key>` (what the OpenAI SDK sends), else `x-api-key`."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        return value.strip() if scheme.lower() == "bearer" else ""
    api_key = headers.get("x-api-key")
    return None if api_key is None else api_key.strip()


def missing_key() -> ApiError:
    return ApiError(
        401,
        "no API key: send it as `Authorization: Bearer <key>` or in `x-api-key`",
        "invalid_request_error",
        None,
        "missing_api_key",
    )


def invalid_key() -> ApiError:
    # The key is never echoed, not even in part.
    return ApiError(
        401, "the API key is not valid", "invalid_request_error", None, "invalid_api_key"
    )


class Authenticator:
    def __init__(
        self,
        keyfile: KeyFile | None,
        redis_keys: RedisKeys | None,
        *,
        cache_ttl_s: float = 5.0,
        stale_s: float = 60.0,
        lookup_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keyfile = keyfile
        self.redis_keys = redis_keys
        self.cache_ttl_s = cache_ttl_s
        self.stale_s = stale_s
        self.lookup_timeout_s = lookup_timeout_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[ApiKey | None, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[ApiKey | None]] = {}
        self.redis_lookups = 0

    async def check(self, presented: str | None) -> ApiKey:
        if presented is None:
            raise missing_key()
        if not presented or len(presented) > MAX_KEY_CHARS or not presented.isprintable():
            raise invalid_key()
        sha = hash_key(presented)
        if self.keyfile is not None and (entry := self.keyfile.lookup(sha)) is not None:
            return entry
        if self.redis_keys is None:
            raise invalid_key()
        entry = await self._from_redis(sha)
        if entry is None:
            raise invalid_key()
        return entry

    async def _from_redis(self, sha: str) -> ApiKey | None:
        now = self._clock()
        cached = self._cache.get(sha)
        if cached is not None and now - cached[1] < self.cache_ttl_s:
            return cached[0]
        pending = self._pending.get(sha)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[ApiKey | None] = asyncio.get_running_loop().create_future()
        self._pending[sha] = future
        try:
            entry = await self._lookup(sha, cached, now)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lookup no one else waited on is not an error
            raise
        else:
            future.set_result(entry)
            return entry
        finally:
            del self._pending[sha]

    async def _lookup(
        self, sha: str, cached: tuple[ApiKey | None, float] | None, now: float
    ) -> ApiKey | None:
        assert self.redis_keys is not None
        self.redis_lookups += 1
        try:
            entry = await asyncio.wait_for(self.redis_keys.lookup(sha), self.lookup_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            if cached is not None and now - cached[1] < self.stale_s:
                log.warning("Redis did not answer a key check (%r): using the cached answer", exc)
                return cached[0]
            log.warning("Redis did not answer a key check: %r", exc)
            raise ApiError.unavailable(
                "API keys cannot be checked now (the key store is unavailable)",
                "auth_unavailable",
            ) from exc
        except ValueError as exc:  # an entry that does not parse: refuse the key
            log.error("an API key entry in Redis is not valid: %s", exc)
            entry = None
        self._cache[sha] = (entry, now)
        self._cache.move_to_end(sha)
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return entry
