"""A lease in Redis: one holder at a time of a name, until `ttl_s` after its last renewal.

    lease = Lease(store, "radixserve.scheduler", holder="scheduler-a", ttl_s=3.0)
    await lease.claim()        # the holder now: "scheduler-a" when ours (taken or renewed)
    await lease.release()      # True when it was ours and is free now

    keeper = LeaseKeeper(lease, on_won=serve, on_lost=step_down, on_error=count)
    await keeper.step()        # one claim now; then, a supervised task:
    ctx.spawn(keeper.run(), "lease")
    await keeper.release()     # stop claiming and free it (a clean shutdown)

The key (`<prefix>lease:<name>`) holds the holder's id with a TTL: taken with SET NX PX
when free, renewed (PEXPIRE) only by its holder, in one Lua script each, so two claimants
never both hold it. A holder that stops renewing (killed, cut off from Redis) loses it
`ttl_s` later; one that releases it frees it at once.

`LeaseKeeper` claims every `ttl_s / 3` while it holds the lease (two renewals may fail
before it expires) and every `ttl_s / 6` while it waits for it (a free lease is taken
within that). Redis unreachable changes nothing: a holder goes on believing it holds the
lease (what it guards must not stop because Redis did), a waiter goes on waiting; each
failure goes to `on_error`. Only an answer naming another holder deposes a holder.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from radixserve.store.client import Store

log = logging.getLogger(__name__)

# KEYS[1]: the lease; ARGV[1]: the claimant; ARGV[2]: the TTL in ms. Returns the holder.
_CLAIM_LUA = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return holder
"""

# Deletes the lease only if ARGV[1] holds it: 1 when it did.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_LOG_EVERY_S = 10.0


class Lease:
    def __init__(self, store: Store, name: str, *, holder: str, ttl_s: float) -> None:
        if not name or not holder:
            raise ValueError("a lease needs a name and a holder id")
        if not ttl_s > 0:
            raise ValueError(f"the lease TTL must be > 0 s, got {ttl_s}")
        self.store = store
        self.key = store.key("lease", name)
        self.holder = holder
        self.ttl_s = ttl_s
        self._claim = store.redis.register_script(_CLAIM_LUA)
        self._release = store.redis.register_script(_RELEASE_LUA)

    async def claim(self) -> str:
        """Take the lease if it is free, renew it if it is ours; who holds it now."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        return str(await self._claim(keys=[self.key], args=[self.holder, ttl_ms]))

    async def release(self) -> bool:
        """Free the lease if it is ours (another's is left alone); True when it was."""
        return int(await self._release(keys=[self.key], args=[self.holder])) == 1

    async def current_holder(self) -> str | None:
        holder = await self.store.redis.get(self.key)
        return None if holder is None else str(holder)


Callback = Callable[[], Awaitable[None]]


class LeaseKeeper:
    """Keeps claiming `lease`; `on_won` when it becomes ours, `on_lost(holder)` when an
    answer names another holder, `on_error(exc)` for a claim that failed."""

    def __init__(
        self,
        lease: Lease,
        *,
        on_won: Callback,
        on_lost: Callable[[str], Awaitable[None]],
        on_error: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.lease = lease
        self.on_won = on_won
        self.on_lost = on_lost
        self.on_error = on_error
        self.held = False
        self._released = False
        # One claim at a time, and none in flight once released: a late one would take
        # the lease again just freed.
        self._claiming = asyncio.Lock()
        self._last_log = 0.0

    @property
    def interval_s(self) -> float:
        return self.lease.ttl_s / (3 if self.held else 6)

    async def run(self) -> None:
        """Claim forever (a supervised task); ends once released."""
        while not self._released:
            await asyncio.sleep(self.interval_s)
            await self.step()

    async def step(self) -> str | None:
        """One claim (bounded by the claim interval), and the callback its answer calls
        for; the holder it named (None: no answer)."""
        async with self._claiming:
            if self._released:
                return None
            return await self._claim()

    async def _claim(self) -> str | None:
        try:
            holder = await asyncio.wait_for(self.lease.claim(), self.interval_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self.on_error(exc)
            self._warn("lease %s not claimed (%s it): %r", self.lease.key, self._state, exc)
            return None
        if holder == self.lease.holder and not self.held:
            self.held = True
            log.info("lease %s taken: this instance is active", self.lease.key)
            await self.on_won()
        elif holder != self.lease.holder and self.held:
            self.held = False
            log.warning("lease %s is held by %s: stepping down", self.lease.key, holder)
            await self.on_lost(holder)
        return holder

    async def release(self, timeout_s: float = 2.0) -> None:
        """Claim no more, and free the lease if held, so a waiter takes it at once. A
        release that fails is logged: the lease then expires after its TTL."""
        self._released = True
        async with self._claiming:
            if self.held:
                self.held = False
                await self._release(timeout_s)

    async def _release(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.lease.release(), timeout_s)
            log.info("lease %s released", self.lease.key)
        except (RedisError, OSError, TimeoutError) as exc:
            self.on_error(exc)
            log.warning(
                "lease %s not released (%r): it expires in %g s",
                self.lease.key,
                exc,
                self.lease.ttl_s,
            )

    async def wait_taken(self, timeout_s: float) -> str | None:
        """After `release`: until another instance holds the lease (its id), or None
        after `timeout_s` (no waiter, or Redis unreachable)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                holder = await asyncio.wait_for(self.lease.current_holder(), timeout_s)
            except (RedisError, OSError, TimeoutError):
                return None
            if holder is not None and holder != self.lease.holder:
                return holder
            await asyncio.sleep(0.05)
        return None

    @property
    def _state(self) -> str:
        return "holding" if self.held else "waiting for"

    def _warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            log.warning(message, *args)
            self._last_log = now
