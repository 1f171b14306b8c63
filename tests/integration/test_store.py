"""radixserve.store against a real redis-server: request records with TTL, the
token-bucket limiter (checked against a Python model of the same bucket), health."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from radixserve.infra import free_port
from radixserve.store import Bucket, Store, StoreConnectError, StoreSettings

pytestmark = pytest.mark.timeout(30)


async def test_put_get_request_record_with_ttl(store: Store) -> None:
    await store.put_request("r1", {"model": "m", "prompt_tokens": 12, "temperature": 0.5}, 60)
    assert await store.get_request("r1") == {
        "model": "m",
        "prompt_tokens": "12",
        "temperature": "0.5",
    }
    key = f"{store.settings.key_prefix}req:r1"
    ttl = await store.redis.ttl(key)
    assert 0 < ttl <= 60
    remaining = await store.request_ttl_s("r1")
    assert remaining is not None and 59 < remaining <= 60


async def test_put_replaces_the_whole_record(store: Store) -> None:
    await store.put_request("r2", {"a": "1", "b": "2"}, 60)
    await store.put_request("r2", {"c": "3"}, 60)
    assert await store.get_request("r2") == {"c": "3"}


async def test_update_merges_and_keeps_or_resets_ttl(store: Store) -> None:
    await store.put_request("r3", {"status": "queued", "n": 1}, 30)
    assert await store.update_request("r3", {"status": "running"})
    assert await store.get_request("r3") == {"status": "running", "n": "1"}
    kept = await store.request_ttl_s("r3")
    assert kept is not None and 0 < kept <= 30
    assert await store.update_request("r3", {"n": 2}, ttl_s=300)
    reset = await store.request_ttl_s("r3")
    assert reset is not None and 30 < reset <= 300


async def test_update_of_a_missing_record_writes_nothing(store: Store) -> None:
    assert not await store.update_request("ghost", {"status": "x"})
    assert await store.get_request("ghost") is None
    assert await store.request_ttl_s("ghost") is None


async def test_record_expires(store: Store) -> None:
    await store.put_request("short", {"x": 1}, ttl_s=0.2)
    assert await store.get_request("short") is not None
    deadline = time.monotonic() + 3.0
    while await store.get_request("short") is not None:
        assert time.monotonic() < deadline, "record outlived its TTL"
        await asyncio.sleep(0.05)


async def test_delete_request(store: Store) -> None:
    await store.put_request("gone", {"x": 1}, 60)
    assert await store.delete_request("gone")
    assert await store.get_request("gone") is None
    assert not await store.delete_request("gone")


async def test_bad_record_input_is_rejected(store: Store) -> None:
    with pytest.raises(ValueError, match="empty"):
        await store.put_request("r", {}, 60)
    with pytest.raises(TypeError, match="flag"):
        await store.put_request("r", {"flag": True}, 60)
    with pytest.raises(ValueError, match="ttl_s"):
        await store.put_request("r", {"x": 1}, 0)
    with pytest.raises(ValueError, match="request id"):
        await store.get_request("")
    assert await store.get_request("r") is None


async def test_limiter_allows_burst_then_denies(store: Store) -> None:
    rate, burst = 1.0, 5
    decisions = [await store.allow("k", rate, burst) for _ in range(burst + 1)]
    assert [d.allowed for d in decisions] == [True] * burst + [False]
    # Between calls only microseconds pass: refill is far below one token.
    for expected, decision in zip([4, 3, 2, 1, 0], decisions, strict=False):
        assert abs(decision.remaining - expected) < 0.1
    denied = decisions[-1]
    assert 0.9 < denied.retry_after_s <= 1.0 / rate
    assert all(d.retry_after_s == 0 for d in decisions[:burst])


async def test_limiter_refills_over_time(store: Store) -> None:
    rate, burst = 20.0, 2
    assert (await store.allow("refill", rate, burst)).allowed
    assert (await store.allow("refill", rate, burst)).allowed
    denied = await store.allow("refill", rate, burst)
    assert not denied.allowed and 0 < denied.retry_after_s <= 1 / rate
    await asyncio.sleep(denied.retry_after_s + 0.05)
    assert (await store.allow("refill", rate, burst)).allowed


async def test_limiter_matches_a_python_bucket(store: Store) -> None:
    # Refill of 1e-3 token/s cannot flip an integral decision within this test,
    # so the Redis bucket must agree with a refill-free model call by call.
    rng = random.Random(7)
    burst, tokens = 10, 10
    for _ in range(30):
        cost = rng.randint(1, 4)
        decision = await store.allow("model", 1e-3, burst, cost)
        expected = tokens >= cost
        tokens -= cost if expected else 0
        assert decision.allowed == expected
        assert abs(decision.remaining - tokens) < 0.01


async def test_limiter_is_atomic_under_concurrency(store: Store) -> None:
    decisions = await asyncio.gather(*(store.allow("race", 1e-3, 10) for _ in range(50)))
    assert sum(d.allowed for d in decisions) == 10


async def test_limiter_keys_are_independent_and_inputs_checked(store: Store) -> None:
    assert (await store.allow("a", 1e-3, 1)).allowed
    assert not (await store.allow("a", 1e-3, 1)).allowed
    assert (await store.allow("b", 1e-3, 1)).allowed
    with pytest.raises(ValueError, match="exceeds burst"):
        await store.allow("a", 1.0, 2, cost=3)
    with pytest.raises(ValueError, match="rate_per_s"):
        await store.allow("a", 0.0, 2)


async def test_health(store: Store) -> None:
    health = await store.health()
    assert health.ok and health.latency_s is not None and health.latency_s < 1.0


async def test_connect_gives_up_when_nothing_listens() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = StoreSettings(
        url=url, connect_attempts=2, connect_timeout_s=0.3, connect_backoff_s=0.05
    )
    started = time.monotonic()
    with pytest.raises(StoreConnectError, match="2 attempts"):
        await Store.connect(settings)
    assert time.monotonic() - started < 3.0


async def test_limiter_decides_several_buckets_at_once(store: Store) -> None:
    # Requests/min and tokens/min of one key: allowed only when both have the cost,
    # and then both pay; a refusal takes from neither.
    requests, tokens = Bucket("k:req", 1e-3, 3), Bucket("k:tok", 1e-3, 2)
    first = await store.allow_all([requests, tokens])
    second = await store.allow_all([requests, tokens])
    third = await store.allow_all([requests, tokens])
    assert [d.allowed for d in first + second + third] == [True] * 4 + [False] * 2
    assert [round(d.remaining) for d in third] == [1, 0]
    assert third[0].retry_after_s == 0 and third[1].retry_after_s > 900  # 1 token at 1e-3/s
    # The refusal took nothing: the request bucket still has its last token.
    assert (await store.allow("k:req", 1e-3, 3)).allowed
    assert not (await store.allow("k:req", 1e-3, 3)).allowed


async def test_limiter_charge_overdraws_and_then_refuses(store: Store) -> None:
    # A charge of usage known after the request goes below zero; the bucket refuses
    # until it has refilled past the debt.
    assert (await store.allow("tok", 1.0, 10)).allowed
    debt = await store.charge("tok", 1.0, 10, 25)
    assert debt.allowed and -16.1 < debt.remaining < -15.9
    assert 15.9 < debt.retry_after_s < 16.1
    refused = await store.allow("tok", 1.0, 10)
    assert not refused.allowed and 16.9 < refused.retry_after_s < 17.1
    with pytest.raises(ValueError, match="no buckets"):
        await store.allow_all([])
