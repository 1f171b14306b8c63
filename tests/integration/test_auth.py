"""The auth library against a real Redis: keys in Redis and in a file, the checker's
cache (and what it does while Redis is down), the rate limiter's headers and 429."""

from __future__ import annotations

import argparse
import json
import os
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from radixserve.api import ApiError
from radixserve.auth import (
    ApiKey,
    Authenticator,
    AuthSettings,
    KeyExists,
    KeyFile,
    KeyFileError,
    KeyRateLimiter,
    RateLimited,
    RedisKeys,
    generate_key,
    hash_key,
    presented_key,
    read_keys,
    write_keys,
)
from radixserve.auth import settings as auth_settings
from radixserve.auth.rate_limits import duration
from radixserve.infra import RedisServer
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.runtime import ServiceSettings
from radixserve.store import Store, StoreSettings


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    s = await Store.connect(StoreSettings(url=redis_url, key_prefix=f"t-{uuid.uuid4().hex[:8]}:"))
    yield s
    await s.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keys_are_hashed_and_entries_validated() -> None:
    key = generate_key()
    assert key.startswith("rsk-") and len(key) > 40 and generate_key() != key
    assert hash_key(key) == hash_key(key) and len(hash_key(key)) == 64
    entry = ApiKey("ci", hash_key(key), frozenset({"inference"}), rpm=5, priority="high")
    assert ApiKey.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry
    assert key not in repr(entry) and hash_key(key) not in repr(entry)
    assert entry.priority_value == 10
    for bad, match in (
        ({"name": "a b", "sha256": "0" * 64}, "key name"),
        ({"name": "a", "sha256": "xyz"}, "sha256"),
        ({"name": "a", "sha256": "0" * 64, "scopes": ["root"]}, "unknown scope"),
        ({"name": "a", "sha256": "0" * 64, "rpm": 0}, "rpm"),
        ({"name": "a", "sha256": "0" * 64, "rpm": True}, "rpm"),
        ({"name": "a", "sha256": "0" * 64, "priority": "urgent"}, "priority"),
        ({"name": "a", "sha256": "0" * 64, "key": "plain"}, "unknown field"),
    ):
        with pytest.raises(ValueError, match=match):
            ApiKey.from_dict(bad)


def test_presented_key_reads_bearer_then_x_api_key() -> None:
    assert presented_key({"authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer  abc "}) == "abc"
    assert presented_key({"authorization": "Basic abc"}) == ""  # present, and wrong
    assert presented_key({"x-api-key": "abc"}) == "abc"
    assert presented_key({}) is None


def test_keys_file_round_trip_reload_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    a, b = generate_key(), generate_key()
    write_keys(path, [ApiKey("a", hash_key(a))])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = KeyFile(path)
    assert keys.lookup(hash_key(a)) is not None and keys.lookup(hash_key(b)) is None
    assert not keys.reload()  # unchanged
    write_keys(path, [ApiKey("a", hash_key(a)), ApiKey("b", hash_key(b))])
    assert keys.reload() and keys.lookup(hash_key(b)) is not None
    path.write_text("{not json")
    assert not keys.reload()  # a bad version keeps the keys there were
    assert keys.lookup(hash_key(b)) is not None
    for text, match in (
        ("[]", '"keys" list'),
        ('{"keys": [{"name": "a"}]}', r"keys\[0\]"),
        (json.dumps({"keys": [ApiKey("a", hash_key(a)).to_dict()] * 2}), "same name"),
    ):
        path.write_text(text)
        with pytest.raises(KeyFileError, match=match):
            read_keys(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyFile(tmp_path / "missing.json")


async def test_redis_keys_create_list_revoke(store: Store) -> None:
    keys = RedisKeys(store)
    key = generate_key()
    entry = ApiKey("ci", hash_key(key), frozenset({"inference", "metrics"}), tpm=100)
    await keys.create(entry)
    with pytest.raises(KeyExists):
        await keys.create(ApiKey("ci", hash_key(generate_key())))
    assert await keys.lookup(hash_key(key)) == entry
    assert [k.name for k in await keys.list()] == ["ci"]
    # Nothing stored holds the key itself.
    for name in await store.redis.keys(store.key("*")):
        assert key not in json.dumps(await store.redis.hgetall(name))  # type: ignore[misc]
    assert await keys.revoke("ci") and not await keys.revoke("ci")
    assert await keys.lookup(hash_key(key)) is None


async def test_checker_caches_redis_answers_and_rides_out_an_outage(tmp_path: Path) -> None:
    clock = Clock()
    with RedisServer() as redis:
        store = await Store.connect(
            StoreSettings(url=redis.url, socket_timeout_s=0.5, connect_timeout_s=0.5)
        )
        try:
            redis_keys = RedisKeys(store)
            good, unknown = generate_key(), generate_key()
            await redis_keys.create(ApiKey("ci", hash_key(good)))
            checker = Authenticator(
                None, redis_keys, cache_ttl_s=5, stale_s=60, lookup_timeout_s=0.5, clock=clock
            )
            assert (await checker.check(good)).name == "ci"
            assert (await checker.check(good)).name == "ci"
            assert checker.redis_lookups == 1  # the second came from the cache
            with pytest.raises(ApiError) as wrong:
                await checker.check(unknown)
            assert (wrong.value.status, wrong.value.code) == (401, "invalid_api_key")
            redis.kill()
            clock.now += 30  # past the cache's 5 s, within its 60 s of grace
            assert (await checker.check(good)).name == "ci"
            with pytest.raises(ApiError) as also_wrong:
                await checker.check(unknown)  # a cached "no such key" stands too
            assert also_wrong.value.status == 401
            with pytest.raises(ApiError) as down:
                await checker.check(generate_key())  # never seen: cannot be vouched for
            assert (down.value.status, down.value.code) == (503, "auth_unavailable")
            clock.now += 60
            with pytest.raises(ApiError) as stale:
                await checker.check(good)
            assert stale.value.status == 503
        finally:
            await store.close()


async def test_checker_prefers_the_file_and_refuses_odd_keys(tmp_path: Path) -> None:
    key = generate_key()
    path = tmp_path / "keys.json"
    write_keys(path, [ApiKey("file", hash_key(key))])
    checker = Authenticator(KeyFile(path), None)
    assert (await checker.check(key)).name == "file"
    for presented, code in (
        (None, "missing_api_key"),
        ("", "invalid_api_key"),
        ("x" * 300, "invalid_api_key"),
        (key + "\x00", "invalid_api_key"),
    ):
        with pytest.raises(ApiError) as refused:
            await checker.check(presented)
        assert (refused.value.status, refused.value.code) == (401, code)


async def test_rate_limiter_headers_and_429(store: Store) -> None:
    limiter = KeyRateLimiter(store)
    key = ApiKey("limited", hash_key(generate_key()), rpm=2, tpm=1000)
    first = await limiter.admit(key)
    assert first["x-ratelimit-limit-requests"] == "2"
    assert first["x-ratelimit-remaining-requests"] == "1"
    assert first["x-ratelimit-limit-tokens"] == "1000"
    assert first["x-ratelimit-remaining-tokens"] == "999"
    await limiter.admit(key)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(key)
    error = refused.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    headers = error.headers()
    assert 29 <= int(headers["Retry-After"]) <= 30  # one request back every 30 s
    assert 29_000 <= int(headers["retry-after-ms"]) <= 30_000
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert await limiter.admit(ApiKey("free", hash_key(generate_key()))) == {}


def test_duration_is_openais_format() -> None:
    assert [duration(s) for s in (0.02, 1, 59.2, 360)] == ["20ms", "1s", "1m0s", "6m0s"]


def test_without_keys_only_loopback_is_served() -> None:
    service = ServiceSettings.from_env("gateway")
    assert GatewaySettings(service=service, host="127.0.0.1")
    assert GatewaySettings(service=service, host="::1")
    with pytest.raises(ValueError, match="without API keys"):
        GatewaySettings(service=service, host="0.0.0.0")
    open_on_purpose = AuthSettings(allow_unauthenticated=True)
    assert GatewaySettings(service=service, host="0.0.0.0", auth=open_on_purpose)
    assert GatewaySettings(service=service, host="0.0.0.0", auth=AuthSettings(require_api_key=True))


def test_auth_settings_from_flags_and_environment(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    auth_settings.add_arguments(parser)
    none = auth_settings.settings_from(parser.parse_args([]), {})
    assert not none.enabled
    from_env = auth_settings.settings_from(
        parser.parse_args([]),
        {"RADIXSERVE_API_KEYS_FILE": "/s/keys.json", "RADIXSERVE_API_KEY_CACHE_S": "2"},
    )
    assert from_env.enabled and from_env.keys_file == Path("/s/keys.json")
    assert from_env.cache_ttl_s == 2
    flags = auth_settings.settings_from(
        parser.parse_args(["--require-api-key", "--api-key-cache-s", "120"]), {}
    )
    assert flags.enabled and flags.cache_ttl_s == 120 and flags.stale_s == 120
    with pytest.raises(ValueError, match="RADIXSERVE_REQUIRE_API_KEY"):
        auth_settings.settings_from(parser.parse_args([]), {"RADIXSERVE_REQUIRE_API_KEY": "maybe"})


def test_gateway_refuses_to_start_exposed_without_keys() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "gateway", "--host", "0.0.0.0"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "without API keys" in done.stderr
