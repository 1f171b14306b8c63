"""The Redis lease (store/lease.py) against a real redis-server: one holder of two
contenders, renewal, expiry when the holder stops renewing, release, a holder that finds
another one steps down, and a Redis that is not there."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.infra import free_port
from radixserve.store import Store, StoreSettings
from radixserve.store.lease import Lease, LeaseKeeper

pytestmark = pytest.mark.timeout(30)

TTL_S = 1.0  # renewals every third of it: a stall of 0.6 s on a loaded machine is fine


class Events:
    """What a keeper's callbacks saw, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.errors: list[BaseException] = []

    async def won(self) -> None:
        self.seen.append("won")

    async def lost(self, holder: str) -> None:
        self.seen.append(f"lost to {holder}")

    def keeper(self, lease: Lease) -> LeaseKeeper:
        return LeaseKeeper(lease, on_won=self.won, on_lost=self.lost, on_error=self.errors.append)


def lease(store: Store, holder: str, ttl_s: float = TTL_S) -> Lease:
    return Lease(store, "p:scheduler", holder=holder, ttl_s=ttl_s)


async def test_one_of_two_contenders_wins_and_renews_past_the_ttl(store: Store) -> None:
    a, b = lease(store, "a"), lease(store, "b")
    holders = await asyncio.gather(a.claim(), b.claim())
    winner = holders[0]
    assert holders == [winner, winner] and winner in ("a", "b")
    first, second = (a, b) if winner == "a" else (b, a)
    for _ in range(4):  # renewed every third of the TTL, for twice the TTL
        await asyncio.sleep(TTL_S / 3)
        assert await first.claim() == winner
        assert await second.claim() == winner
    ttl_ms = int(await store.redis.pttl(first.key))
    assert 0 < ttl_ms <= TTL_S * 1000


async def test_a_lease_not_renewed_expires_and_goes_to_the_other(store: Store) -> None:
    a, b = lease(store, "a"), lease(store, "b")
    assert await a.claim() == "a"
    assert await b.claim() == "a"
    await asyncio.sleep(TTL_S + 0.2)  # a stopped renewing (killed, cut off)
    assert await b.claim() == "b"
    assert await a.claim() == "b"


async def test_release_frees_only_the_holders_own_lease(store: Store) -> None:
    a, b = lease(store, "a"), lease(store, "b")
    assert await a.claim() == "a"
    assert not await b.release()  # not b's to free
    assert await a.current_holder() == "a"
    assert await a.release()
    assert await a.current_holder() is None
    assert await b.claim() == "b"


async def test_keepers_never_both_hold_and_a_release_hands_over_at_once(store: Store) -> None:
    events_a, events_b = Events(), Events()
    keeper_a, keeper_b = events_a.keeper(lease(store, "a")), events_b.keeper(lease(store, "b"))
    await keeper_a.step()
    await keeper_b.step()
    assert (keeper_a.held, keeper_b.held) == (True, False)
    tasks = [asyncio.create_task(k.run()) for k in (keeper_a, keeper_b)]
    try:
        for _ in range(int(3 * TTL_S / 0.02)):  # three TTLs: renewed, never both
            assert not (keeper_a.held and keeper_b.held)
            await asyncio.sleep(0.02)
        assert keeper_a.held and events_b.seen == []
        await keeper_a.release()
        assert await keeper_a.wait_taken(2 * TTL_S) == "b"
        assert keeper_b.held and not keeper_a.held
        assert events_a.seen == ["won"] and events_b.seen == ["won"]
    finally:
        await keeper_b.release()
        await asyncio.gather(*tasks)
    assert await store.redis.exists(keeper_b.lease.key) == 0


async def test_a_holder_that_finds_another_holder_steps_down(store: Store) -> None:
    events = Events()
    keeper = events.keeper(lease(store, "a"))
    await keeper.step()
    assert keeper.held
    # Its renewals stopped past the TTL (a stalled process) and "b" took the lease.
    await store.redis.set(keeper.lease.key, "b", px=int(TTL_S * 1000))
    assert await keeper.step() == "b"
    assert not keeper.held
    assert events.seen == ["won", "lost to b"]
    await keeper.release()  # not its lease: left alone
    assert await keeper.lease.current_holder() == "b"


async def test_without_redis_a_holder_keeps_holding_and_a_waiter_keeps_waiting(
    store: Store,
) -> None:
    events = Events()
    keeper = events.keeper(lease(store, "a"))
    await keeper.step()
    assert keeper.held
    # Pointed at a port nobody listens on: Redis down, for this keeper.
    down = Store(StoreSettings(url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.2))
    try:
        keeper.lease = Lease(down, "p:scheduler", holder="a", ttl_s=TTL_S)
        waiting = events.keeper(Lease(down, "p:scheduler", holder="b", ttl_s=TTL_S))
        for _ in range(3):
            assert await keeper.step() is None
            assert await waiting.step() is None
        assert keeper.held and not waiting.held
        assert events.seen == ["won"] and len(events.errors) == 6
        await keeper.release()  # fails, logged: it would expire after its TTL
        assert len(events.errors) == 7
    finally:
        await down.close()


async def test_bad_leases_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="TTL"):
        Lease(store, "p:scheduler", holder="a", ttl_s=0)
    with pytest.raises(ValueError, match="holder"):
        Lease(store, "p:scheduler", holder="", ttl_s=1)
