"""Per-key requests/min and tokens/min, in the store's shared token buckets.

    limiter = KeyRateLimiter(store)
    headers = await limiter.admit(key)      # x-ratelimit-* ; ApiError 429 when over
    limiter.charge_soon(key, tokens)        # prompt + completion, once the request ends
    await limiter.run()                     # supervised: writes the charges

A request is admitted when the key's request bucket has one left and its token bucket
is not overdrawn (its tokens are known only once it ends: then they are charged, and
the bucket may go below zero, which holds the next requests back until it refills).
Both buckets live in Redis, so every gateway replica draws on the same ones. When
Redis does not answer, requests are admitted (an outage of the limiter is not one of
the API) and it is logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from radixserve.api import ApiError
from radixserve.auth.keys import ApiKey
from radixserve.store import Bucket, RateLimitDecision, Store

log = logging.getLogger(__name__)

_WINDOW_S = 60.0
_CHARGE_QUEUE = 10_000
_WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class _Limit:
    kind: str  # "requests" or "tokens", as OpenAI names them in headers and errors
    limit: int
    bucket: Bucket


def _limits(key: ApiKey) -> list[_Limit]:
    limits = []
    if key.rpm is not None:
        limits.append(
            _Limit("requests", key.rpm, Bucket(f"key:{key.name}:rpm", key.rpm / _WINDOW_S, key.rpm))
        )
    if key.tpm is not None:
        limits.append(
            _Limit("tokens", key.tpm, Bucket(f"key:{key.name}:tpm", key.tpm / _WINDOW_S, key.tpm))
        )
    return limits


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _headers(limits: list[_Limit], decisions: list[RateLimitDecision]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for limit, decision in zip(limits, decisions, strict=True):
        remaining = max(0, math.floor(decision.remaining))
        headers[f"x-ratelimit-limit-{limit.kind}"] = str(limit.limit)
        headers[f"x-ratelimit-remaining-{limit.kind}"] = str(remaining)
        refill_s = (limit.limit - decision.remaining) / limit.bucket.rate_per_s
        headers[f"x-ratelimit-reset-{limit.kind}"] = duration(max(0.0, refill_s))
    return headers


@dataclass(eq=False)
class RateLimited(ApiError):
    """The 429 of a key over a limit: Retry-After (and the `retry-after-ms` the OpenAI
    SDK reads first) and the key's x-ratelimit-* headers."""

    limit_headers: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        wait_ms = math.ceil((self.retry_after_s or 0.0) * 1000)
        return {**super().headers(), **self.limit_headers, "retry-after-ms": str(wait_ms)}


class KeyRateLimiter:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._charges: asyncio.Queue[tuple[ApiKey, int]] = asyncio.Queue(_CHARGE_QUEUE)
        self._warned_at = -math.inf

    async def admit(self, key: ApiKey) -> dict[str, str]:
        """The x-ratelimit-* headers of an admitted request; ApiError 429 otherwise."""
        limits = _limits(key)
        if not limits:
            return {}
        try:
            decisions = await self.store.allow_all([limit.bucket for limit in limits])
        except (RedisError, OSError, TimeoutError) as exc:
            self._warn(f"rate limits not applied, Redis did not answer: {exc!r}")
            return {}
        headers = _headers(limits, decisions)
        if decisions[0].allowed:
            return headers
        waits = [d.retry_after_s for d in decisions]
        worst = max(range(len(limits)), key=lambda i: waits[i])
        kind, wait_s = limits[worst].kind, waits[worst]
        raise RateLimited(
            429,
            f"rate limit reached for {kind} of key {key.name!r}: limit "
            f"{limits[worst].limit}/min; try again in {duration(wait_s)}",
            kind,
            None,
            "rate_limit_exceeded",
            retry_after_s=wait_s,
            limit_headers=headers,
        )

    def charge_soon(self, key: ApiKey, tokens: int) -> None:
        """Charge a finished request's tokens to its key (the one token `admit` took
        is counted in)."""
        if key.tpm is None or tokens <= 1:
            return
        try:
            self._charges.put_nowait((key, tokens - 1))
        except asyncio.QueueFull:
            self._warn("token charges are behind: one is dropped")

    async def run(self) -> None:
        while True:
            key, tokens = await self._charges.get()
            assert key.tpm is not None
            try:
                await self.store.charge(f"key:{key.name}:tpm", key.tpm / _WINDOW_S, key.tpm, tokens)
            except (RedisError, OSError, TimeoutError) as exc:
                self._warn(f"a token charge was not written, Redis did not answer: {exc!r}")

    async def drain(self, timeout_s: float) -> None:
        """Write the charges still queued, for up to `timeout_s` (on shutdown)."""
        deadline = time.monotonic() + timeout_s
        while not self._charges.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning(message)
