"""Asyncio Redis store: request records and rate limits.

    store = await Store.connect(StoreSettings.from_env())
    await store.put_request(rid, {"model": "smollm2", "prompt_tokens": 12}, ttl_s=600)
    await store.update_request(rid, {"status": "finished"})    # False if it expired
    record = await store.get_request(rid)                      # dict[str, str] | None
    decision = await store.allow(f"key:{api_key}", rate_per_s=5, burst=10)
    if not decision.allowed: reply_429(retry_after=decision.retry_after_s)
    await store.close()

Every key is ``settings.key_prefix`` + a name (``radixserve:req:<rid>``,
``radixserve:rl:<key>``). Values go in as str/int/float and come back as str, as
Redis hashes store them. Multi-step changes run in one transaction or Lua script,
so concurrent gateways never see a record without its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    RedisError,
)

from radixserve.retry import RetriesExhausted, retry_with_backoff
from radixserve.store.ratelimit import (
    TOKEN_BUCKETS_LUA,
    Bucket,
    RateLimitDecision,
    bucket_args,
    check_allowable,
    parse_decisions,
)
from radixserve.store.settings import StoreSettings

log = logging.getLogger(__name__)

FieldValue = str | int | float

# Update only a record that still exists: a plain HSET on an expired record would
# recreate it without a TTL. ARGV[1] = TTL in ms (0 keeps the current one), then pairs.
_UPDATE_IF_EXISTS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
local ttl_ms = tonumber(ARGV[1])
if ttl_ms > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
end
return 1
"""


class StoreConnectError(RuntimeError):
    """Redis did not answer PING within the configured attempts."""


class StoreAuthError(StoreConnectError):
    """Redis refused the credentials: trying again cannot help."""


@dataclass(frozen=True)
class StoreHealth:
    """Result of ``Store.health()``: ``ok`` when PING answered."""

    ok: bool
    latency_s: float | None
    error: str | None = None


class Store:
    """A connected Redis store; create it with ``await Store.connect(...)``."""

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.url, decode_responses=True, **settings.client_options()
        )
        self._buckets = self._redis.register_script(TOKEN_BUCKETS_LUA)
        self._update = self._redis.register_script(_UPDATE_IF_EXISTS_LUA)

    # -- lifecycle -------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: StoreSettings | str | None = None) -> Store:
        """Connect and PING, retrying; raise StoreConnectError after the last attempt.

        ``settings`` may be a URL, a StoreSettings, or None (``StoreSettings.from_env()``)."""
        if isinstance(settings, str):
            settings = StoreSettings(url=settings)
        store = cls(settings or StoreSettings.from_env())
        try:
            await store._ping_with_retry()
        except BaseException:
            await store.close()
            raise
        return store

    async def _ping_with_retry(self) -> None:
        s = self.settings

        async def attempt() -> None:
            try:
                await asyncio.wait_for(self._redis.ping(), s.connect_timeout_s)
            except (AuthenticationError, AuthenticationWrongNumberOfArgsError) as exc:
                # Retrying cannot change Redis's mind about the credentials.
                who = s.auth.identity
                refused = "wants credentials" if s.auth.password is None else f"refused {who}"
                raise StoreAuthError(f"Redis at {s.url} {refused} ({exc})") from None
            except NoPermissionError as exc:
                raise StoreAuthError(
                    f"Redis at {s.url} does not let {s.auth.identity} PING ({exc})"
                ) from None

        try:
            await retry_with_backoff(
                attempt,
                attempts=s.connect_attempts,
                first_delay_s=s.connect_backoff_s,
                max_delay_s=s.connect_backoff_max_s,
                retry_on=(TimeoutError, RedisError, OSError),
                log=log,
                what=f"Redis {s.url} connect",
            )
        except RetriesExhausted as exc:
            raise StoreConnectError(
                f"cannot reach Redis at {s.url} after {s.connect_attempts} attempts: "
                f"{exc.last_error!r}"
            ) from exc.last_error

    async def close(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def redis(self) -> aioredis.Redis:
        """The underlying redis-py client (``decode_responses=True``)."""
        return self._redis

    def key(self, *parts: str) -> str:
        """``key_prefix`` + parts joined by ':'."""
        return self.settings.key_prefix + ":".join(parts)

    async def health(self, timeout_s: float = 1.0) -> StoreHealth:
        """PING round trip; never raises."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._redis.ping(), timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            return StoreHealth(False, None, repr(exc))
        return StoreHealth(True, time.monotonic() - started)

    # -- request records -------------------------------------------------------

    def request_key(self, rid: str) -> str:
        if not rid:
            raise ValueError("request id must not be empty")
        return self.key("req", rid)

    async def put_request(self, rid: str, fields: Mapping[str, FieldValue], ttl_s: float) -> None:
        """Create or replace the record of ``rid``; it expires after ``ttl_s``."""
        key = self.request_key(rid)
        mapping = _encode_fields(fields)
        ttl_ms = _ttl_ms(ttl_s)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
            pipe.pexpire(key, ttl_ms)
            await pipe.execute()

    async def update_request(
        self, rid: str, fields: Mapping[str, FieldValue], ttl_s: float | None = None
    ) -> bool:
        """Set ``fields`` on an existing record (and reset its TTL when ``ttl_s`` is
        given). False, and nothing written, when the record is gone."""
        key = self.request_key(rid)
        mapping = _encode_fields(fields)
        ttl_ms = 0 if ttl_s is None else _ttl_ms(ttl_s)
        args: list[str | int] = [ttl_ms]
        for name, value in mapping.items():
            args += [name, value]
        return int(await self._update(keys=[key], args=args)) == 1

    async def get_request(self, rid: str) -> dict[str, str] | None:
        """The record's fields as strings, or None when it does not exist."""
        raw = await self._redis.hgetall(self.request_key(rid))  # type: ignore[misc]
        # decode_responses=True: keys and values are str.
        record = cast("dict[str, str]", raw)
        return record or None

    async def delete_request(self, rid: str) -> bool:
        """True when a record was deleted."""
        return int(await self._redis.delete(self.request_key(rid))) == 1

    async def request_ttl_s(self, rid: str) -> float | None:
        """Seconds the record has left; None when it does not exist."""
        pttl = int(await self._redis.pttl(self.request_key(rid)))
        if pttl == -2:
            return None
        return math.inf if pttl == -1 else pttl / 1000.0

    # -- rate limits -----------------------------------------------------------

    async def allow(
        self, key: str, rate_per_s: float, burst: int, cost: int = 1
    ) -> RateLimitDecision:
        """Take ``cost`` tokens from the bucket ``key`` (refilling at ``rate_per_s``
        up to ``burst``) if it has them; one atomic step in Redis."""
        (decision,) = await self.allow_all([Bucket(key, rate_per_s, burst, cost)])
        return decision

    async def allow_all(self, buckets: Sequence[Bucket]) -> list[RateLimitDecision]:
        """Take each bucket's cost if every one has it, else nothing; one atomic step.
        One decision per bucket, in order (each with the shared `allowed`)."""
        if not buckets:
            raise ValueError("no buckets to decide on")
        for bucket in buckets:
            check_allowable(bucket)
        return await self._run_buckets(buckets, force=False)

    async def charge(self, key: str, rate_per_s: float, burst: int, cost: int) -> RateLimitDecision:
        """Take ``cost`` tokens from the bucket ``key`` whatever it holds (it may go
        below zero, and then refuses until it has refilled)."""
        (decision,) = await self._run_buckets([Bucket(key, rate_per_s, burst, cost)], force=True)
        return decision

    async def _run_buckets(self, buckets: Sequence[Bucket], force: bool) -> list[RateLimitDecision]:
        reply = await self._buckets(
            keys=[self.key("rl", b.key) for b in buckets], args=bucket_args(buckets, force)
        )
        return parse_decisions(list(reply))


def _encode_fields(fields: Mapping[str, FieldValue]) -> dict[str, str]:
    if not fields:
        raise ValueError("fields must not be empty")
    encoded: dict[str, str] = {}
    for name, value in fields.items():
        # bool is an int subclass; "True" in Redis would read back as a string no one expects.
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(
                f"field {name!r}: expected str, int or float, got {type(value).__name__}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"field {name!r}: {value} is not a finite number")
        encoded[name] = value if isinstance(value, str) else repr(value)
    return encoded


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, math.ceil(ttl_s * 1000))
