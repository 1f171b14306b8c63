"""API keys at the gateway: two gateway processes with one keys file and keys in Redis,
the rest of the request path played over real NATS (tests/fixtures/gateway.py), the
official openai client.

401 for no, wrong, malformed or revoked keys; 403 for a missing scope; 200 for the
right one; 429 with Retry-After past a key's requests/min or tokens/min, shared by both
gateways, another key unaffected; nothing presented is logged.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.auth import ApiKey, generate_key, hash_key, write_keys
from radixserve.bus import Bus
from radixserve.infra import free_port
from radixserve.protocol import Subjects
from tests.fixtures.gateway import REQUEST_TIMEOUT_S, WAIT_S, FakePipeline, Gateway, start_gateway

pytestmark = pytest.mark.slow

KEYS = {
    name: generate_key()
    for name in ("admin", "user", "other", "metrics", "limited", "tokens", "high")
}
ENTRIES = [
    ApiKey("admin", hash_key(KEYS["admin"]), frozenset({"inference", "admin", "metrics"})),
    ApiKey("user", hash_key(KEYS["user"])),
    ApiKey("other", hash_key(KEYS["other"])),
    ApiKey("metrics", hash_key(KEYS["metrics"]), frozenset({"metrics"})),
    ApiKey("limited", hash_key(KEYS["limited"]), rpm=3),
    ApiKey("tokens", hash_key(KEYS["tokens"]), tpm=20),
    ApiKey("high", hash_key(KEYS["high"]), priority="high"),
]
CACHE_S = 0.3


class Pair:
    def __init__(
        self, a: Gateway, b: Gateway, redis_prefix: str, redis_url: str, metrics_port: int
    ) -> None:
        self.a, self.b = a, b
        self.metrics_port = metrics_port  # gateway a's internal /metrics, no key
        self.redis_prefix = redis_prefix
        self.redis_url = redis_url

    def logs(self) -> str:
        return self.a.log_path.read_text(errors="replace") + self.b.log_path.read_text(
            errors="replace"
        )


@pytest.fixture(scope="module")
def pair(nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("auth")
    keys_file = root / "api-keys.json"
    write_keys(keys_file, ENTRIES)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    redis_prefix = f"test-{uuid.uuid4().hex[:8]}:"
    env = {"RADIXSERVE_REDIS_PREFIX": redis_prefix}
    flags = (
        "--request-timeout-s", str(REQUEST_TIMEOUT_S),
        "--api-keys-file", str(keys_file), "--api-key-cache-s", str(CACHE_S),
        "--max-stop-strings", "2",
    )  # fmt: skip
    metrics_port = free_port()
    first = start_gateway(
        nats_url, redis_url, root / "a.log", *flags, "--metrics-port", str(metrics_port),
        prefix=prefix, env=env,
    )  # fmt: skip
    second = start_gateway(nats_url, redis_url, root / "b.log", *flags, prefix=prefix, env=env)
    try:
        yield Pair(next(first), next(second), redis_prefix, redis_url, metrics_port)
    finally:
        first.close()
        second.close()


@pytest.fixture
async def pipeline(pair: Pair, nats_url: str) -> AsyncIterator[FakePipeline]:
    bus = await Bus.connect(nats_url)
    fake = FakePipeline(bus, Subjects(pair.a.prefix))
    await fake.start()
    yield fake
    for task in list(fake.tasks):
        task.cancel()
    await bus.close()


def oai(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S
    )


async def chat(gateway: Gateway, key: str, text: str = "hi") -> str:
    async with oai(gateway, key) as client:
        reply = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": text}]
        )
    return reply.choices[0].message.content or ""


def keys_cli(pair: Pair, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RADIXSERVE_REDIS_PREFIX": pair.redis_prefix}
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "keys", *args, "--redis-url", pair.redis_url],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip


async def test_no_key_wrong_key_and_malformed_headers_get_401(
    pair: Pair, pipeline: FakePipeline
) -> None:
    async with oai(pair.a, "rsk-not-a-key") as client:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}]
            )
    assert wrong.value.status_code == 401
    assert wrong.value.code == "invalid_api_key"
    async with httpx.AsyncClient(base_url=pair.a.base_url, timeout=WAIT_S) as http:
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
        cases: list[dict[str, str]] = [
            {},
            {"Authorization": "Bearer"},
            {"Authorization": "Basic " + KEYS["user"]},
            {"Authorization": "Bearer " + "x" * 10_000},
            {"Authorization": "Bearer " + KEYS["user"][:-1]},
            {"x-api-key": ""},
            {"x-api-key": KEYS["user"] + "x"},
            {"x-api-key": KEYS["admin"].upper()},
        ]
        for headers in cases:
            for method, path in (
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("POST", "/flush_cache"),
                ("GET", "/no/such/path"),
                ("GET", "/v1/requests/abc"),
            ):
                reply = await http.request(method, path, json=body, headers=headers)
                assert reply.status_code == 401, (headers.keys(), path, reply.text)
                error = reply.json()["error"]
                assert error["code"] in ("missing_api_key", "invalid_api_key")
                assert reply.headers["www-authenticate"] == "Bearer"
                assert reply.headers["x-request-id"]
        # A non-UTF-8 header value is a wrong key, not a crash.
        reply = await http.get("/v1/models", headers={"Authorization": b"Bearer \xff\xfe"})
        assert reply.status_code == 401
        # The probes stay open.
        for path in ("/health/live", "/health/ready", "/health"):
            assert (await http.get(path)).status_code in (200, 503)
    assert KEYS["user"][:-1] not in pair.logs()


async def test_the_right_key_works_by_bearer_and_by_x_api_key(
    pair: Pair, pipeline: FakePipeline
) -> None:
    assert await chat(pair.a, KEYS["user"])
    async with httpx.AsyncClient(base_url=pair.b.base_url, timeout=WAIT_S) as http:
        reply = await http.post(
            "/v1/completions",
            json={"model": "test-model", "prompt": "hi"},
            headers={"x-api-key": KEYS["user"]},
        )
    assert reply.status_code == 200, reply.text
    assert KEYS["user"] not in pair.logs()


async def test_scopes_decide_flush_cache_and_metrics(pair: Pair, pipeline: FakePipeline) -> None:
    async with httpx.AsyncClient(base_url=pair.a.base_url, timeout=WAIT_S) as http:

        def auth(name: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {KEYS[name]}"}

        denied = await http.post("/flush_cache", headers=auth("user"))
        assert denied.status_code == 403
        assert denied.json()["error"]["code"] == "insufficient_scope"
        flushed = await http.post("/flush_cache", headers=auth("admin"))
        assert flushed.status_code == 200 and flushed.json()["ok"] is True
        assert (await http.get("/metrics", headers=auth("user"))).status_code == 403
        metrics = await http.get("/metrics", headers=auth("metrics"))
        assert metrics.status_code == 200 and "radixserve" in metrics.text
        # The metrics key may read metrics, nothing else.
        assert (await http.get("/v1/models", headers=auth("metrics"))).status_code == 403
    # The internal metrics port (what Prometheus scrapes in compose and the chart) wants
    # no key, and has the gateway's own series.
    internal = httpx.get(f"http://127.0.0.1:{pair.metrics_port}/metrics", timeout=WAIT_S)
    assert internal.status_code == 200
    assert "radixserve:requests_total" in internal.text


async def test_a_request_record_is_its_keys_own(pair: Pair, pipeline: FakePipeline) -> None:
    async with httpx.AsyncClient(base_url=pair.a.base_url, timeout=WAIT_S) as http:
        reply = await http.post(
            "/v1/chat/completions",
            json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {KEYS['user']}"},
        )
        assert reply.status_code == 200
        rid = reply.json()["id"]

        async def record(name: str) -> httpx.Response:
            deadline = time.monotonic() + WAIT_S
            while True:  # records are written behind the answer
                got = await http.get(
                    f"/v1/requests/{rid}", headers={"Authorization": f"Bearer {KEYS[name]}"}
                )
                if got.status_code != 404 or time.monotonic() > deadline:
                    return got
                await asyncio.sleep(0.05)

        own = await record("user")
        assert own.status_code == 200 and own.json()["api_key"] == "user"
        assert (await record("other")).status_code == 403
        assert (await record("admin")).status_code == 200


async def test_keys_made_with_the_cli_work_on_both_gateways_until_revoked(
    pair: Pair, pipeline: FakePipeline
) -> None:
    name = f"cli-{uuid.uuid4().hex[:6]}"
    made = keys_cli(pair, "create", "--name", name)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("rsk-")
    listed = keys_cli(pair, "list")
    assert name in listed.stdout and key not in listed.stdout
    assert await chat(pair.a, key) and await chat(pair.b, key)
    assert keys_cli(pair, "revoke", name).returncode == 0
    for gateway in (pair.a, pair.b):
        deadline = time.monotonic() + CACHE_S + 5
        while True:  # each gateway trusts its cached answer for CACHE_S
            try:
                await chat(gateway, key)
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "a revoked key still works"
            await asyncio.sleep(0.1)
    assert keys_cli(pair, "revoke", name).returncode == 1


async def test_requests_per_minute_are_shared_by_the_gateways(
    pair: Pair, pipeline: FakePipeline
) -> None:
    # rpm 3: three requests, whichever gateway takes them; the fourth is refused.
    async with oai(pair.a, KEYS["limited"]) as client_a, oai(pair.b, KEYS["limited"]) as client_b:
        remaining = []
        for client in (client_a, client_b, client_a):
            raw = await client.chat.completions.with_raw_response.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}]
            )
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        with pytest.raises(openai.RateLimitError) as refused:
            await client_b.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}]
            )
    assert refused.value.status_code == 429
    assert refused.value.code == "rate_limit_exceeded"
    headers = refused.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 20  # a token back every 20 s
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # Another key is not held back.
    assert await chat(pair.b, KEYS["other"])


async def test_tokens_per_minute_hold_the_next_request_back(
    pair: Pair, pipeline: FakePipeline
) -> None:
    # tpm 20: each request is let in while the bucket is not overdrawn, then charged
    # its 14 tokens (10 prompt + 4 completion, as the fake pipeline counts them): the
    # key runs dry within three requests and is then refused for tokens.
    assert await chat(pair.a, KEYS["tokens"])
    deadline = time.monotonic() + WAIT_S
    while True:  # the charge is written behind the answer
        try:
            await chat(pair.b, KEYS["tokens"])
        except openai.RateLimitError as exc:
            assert exc.response.headers["x-ratelimit-limit-tokens"] == "20"
            assert json.loads(exc.response.text)["error"]["type"] == "tokens"
            assert exc.response.headers["x-ratelimit-remaining-tokens"] == "0"
            assert int(exc.response.headers["retry-after"]) >= 3  # a token every 3 s
            break
        assert time.monotonic() < deadline, "an overdrawn key was let in"
        await asyncio.sleep(0.05)


def test_keys_file_is_reloaded_on_change(pair: Pair, tmp_path: Path) -> None:
    keys_file = Path(pair.a.log_path.parent / "api-keys.json")
    added = generate_key()
    before = json.loads(keys_file.read_text())
    write_keys(keys_file, [*ENTRIES, ApiKey("added", hash_key(added))])
    try:
        deadline = time.monotonic() + 10
        while True:
            reply = httpx.get(
                pair.a.base_url + "/v1/models",
                headers={"Authorization": f"Bearer {added}"},
                timeout=WAIT_S,
            )
            if reply.status_code != 401:
                break
            assert time.monotonic() < deadline, "the new key was not picked up"
            time.sleep(0.2)
        assert reply.status_code in (200, 503)  # 503: no worker heartbeat yet
    finally:
        keys_file.write_text(json.dumps(before))


async def test_a_keys_class_caps_the_priority_its_requests_reach(
    pair: Pair, pipeline: FakePipeline
) -> None:
    # What the tokenizer is sent: a "high" key's class when the body asks nothing, a
    # lower value when it asks one, never more than its class; a key without a class
    # is "normal" (0) at most.
    async def submitted_priority(key: str, priority: int | None) -> int:
        extra = {} if priority is None else {"priority": priority}
        async with oai(pair.a, key) as client:
            await client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], extra_body=extra
            )
        return (await pipeline.next_submit()).priority

    assert await submitted_priority(KEYS["high"], None) == 10
    assert await submitted_priority(KEYS["high"], 3) == 3
    assert await submitted_priority(KEYS["high"], 500) == 10
    assert await submitted_priority(KEYS["user"], None) == 0
    assert await submitted_priority(KEYS["user"], 5) == 0
    assert await submitted_priority(KEYS["user"], -5) == -5


async def test_the_gateways_request_limits_are_its_flags(
    pair: Pair, pipeline: FakePipeline
) -> None:
    async with oai(pair.a, KEYS["user"]) as client:
        ok = await client.completions.create(model="test-model", prompt="hi", stop=["a", "b"])
        assert ok.choices[0].text
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="test-model", prompt="hi", stop=["a", "b", "c"])
    assert refused.value.status_code == 400
    assert refused.value.param == "stop"
    assert "--max-stop-strings" in refused.value.message
