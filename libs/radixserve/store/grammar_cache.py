"""Compiled grammars in Redis, shared by grammar-service replicas and kept across restarts.

    cache = RedisGrammarCache(StoreSettings(url=...))
    await cache.put("json_schema:ab12...", entry_bytes)   # SET key value EX ttl
    data = await cache.get("json_schema:ab12...")         # bytes | None

Keys are ``key_prefix`` + ``grammar:`` + the grammar key (`protocol.grammar_key`,
which already names the tokenizer). Values are opaque bytes (the grammar library's
`GrammarEntry`), so this client does not decode responses, unlike `Store`'s. The
cache is an optimisation: every call is bounded by `timeout_s` and a Redis that is
slow or down is logged and reads as a miss; it never fails a request. After a
failure the cache is skipped for `retry_after_s`, so a Redis that is down costs one
timeout per interval, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from radixserve.store.settings import StoreSettings

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 7 * 24 * 3600.0
_WARN_EVERY_S = 30.0
_RETRY_AFTER_S = 10.0


class RedisGrammarCache:
    def __init__(
        self, settings: StoreSettings, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 1.0
    ) -> None:
        if ttl_s <= 0 or timeout_s <= 0:
            raise ValueError("ttl_s and timeout_s must be > 0")
        self.settings = settings
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.failures = 0  # calls that timed out or failed (read as a miss)
        self._last_warning = 0.0
        self._skip_until = 0.0  # after a failure: calls return at once until then
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.url, decode_responses=False, **settings.client_options()
        )

    def key(self, grammar_key: str) -> str:
        return f"{self.settings.key_prefix}grammar:{grammar_key}"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._skip_until

    async def get(self, grammar_key: str) -> bytes | None:
        if not self.available:
            return None
        try:
            value = await asyncio.wait_for(self._redis.get(self.key(grammar_key)), self.timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed("read", exc)
            return None
        if value is None:
            return None
        return value if isinstance(value, bytes) else value.encode()

    async def put(self, grammar_key: str, value: bytes) -> None:
        if not self.available:
            return
        try:
            await asyncio.wait_for(
                self._redis.set(self.key(grammar_key), value, px=int(self.ttl_s * 1000)),
                self.timeout_s,
            )
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed("write", exc)

    async def delete(self, grammar_key: str) -> None:
        try:
            await asyncio.wait_for(self._redis.delete(self.key(grammar_key)), self.timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed("delete", exc)

    async def close(self) -> None:
        await self._redis.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        self._skip_until = now + _RETRY_AFTER_S
        if now - self._last_warning >= _WARN_EVERY_S:  # one line per burst, not per request
            self._last_warning = now
            log.warning("grammar cache %s failed (%d so far): %r", what, self.failures, exc)
