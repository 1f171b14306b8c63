"""The grammar service as processes on real NATS and Redis: compile, cache, fetch.

Two replicas under their own subject prefixes share one Redis key prefix, so a
grammar one compiled is served by the other without compiling (what a second
replica or a restarted one sees). The artifact a fetch returns is loaded with
xgrammar for the same tokenizer, as a worker does, and constrains like a fresh compile.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from radixserve.bus import Bus, BusMsg, BusSettings
from radixserve.protocol import (
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    ServiceHeartbeat,
    Subjects,
    decode,
    encode,
    grammar_key,
)
from tests.helpers.structured_cases import JSON_SCHEMAS, check_json
from tests.helpers.tiny_models import embedded_model_dir

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 90.0
WAIT_S = 10.0


@dataclass
class Replica:
    subjects: Subjects
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(embedded_model_dir())


@pytest.fixture(scope="module")
def replicas(
    nats_url: str, redis_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, Replica]]:
    """Two grammar services, started together, sharing a fresh Redis key prefix."""
    logs = tmp_path_factory.mktemp("grammar")
    env = {**os.environ, "RADIXSERVE_REDIS_PREFIX": f"t{uuid.uuid4().hex[:8]}:"}
    started = []
    try:
        for name in ("a", "b"):
            prefix = f"g{uuid.uuid4().hex[:8]}"
            log = logs / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "radixserve.cli", "serve", "grammar"),
                        *("--nats-url", nats_url, "--redis-url", redis_url),
                        *("--subject-prefix", prefix, "--model", str(model_dir)),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            started.append(Replica(Subjects(prefix), proc, log))
        asyncio.run(_wait_alive(nats_url, started))
        yield started[0], started[1]
    finally:
        for replica in started:
            replica.proc.terminate()
        for replica in started:
            try:
                replica.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait(timeout=5)


async def _wait_alive(nats_url: str, replicas: list[Replica]) -> None:
    bus = await Bus.connect(BusSettings(url=nats_url, name="test-wait"))
    alive: set[str] = set()

    async def on_alive(msg: BusMsg) -> None:
        decode(msg.data, ServiceHeartbeat)
        alive.add(msg.subject.split(".", 1)[0])

    try:
        for replica in replicas:
            await bus.subscribe(replica.subjects.alive_all, on_alive)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(alive) < len(replicas):
            for replica in replicas:
                if replica.proc.poll() is not None:
                    raise AssertionError(f"grammar service exited:\n{replica.log.read_text()}")
            assert time.monotonic() < deadline, [r.log.read_text()[-2000:] for r in replicas]
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    client = await Bus.connect(BusSettings(url=nats_url, name="test-grammar"))
    yield client
    await client.close()


async def _compile(
    bus: Bus, replica: Replica, source: str, kind: str = "json_schema", tokenizer: str = ""
) -> GrammarCompileReply:
    request = GrammarCompileRequest(
        rid=uuid.uuid4().hex,
        kind=kind,
        source=source,
        tokenizer_id=tokenizer,  # type: ignore[arg-type]
    )
    raw = await bus.request(replica.subjects.grammar_compile, encode(request), timeout_s=WAIT_S)
    reply: GrammarCompileReply = decode(raw.data, GrammarCompileReply)
    assert reply.rid == request.rid
    return reply


async def _fetch(bus: Bus, replica: Replica, key: str) -> GrammarFetchReply:
    raw = await bus.request(
        replica.subjects.grammar_fetch,
        encode(GrammarFetchRequest(rid="f", key=key)),
        timeout_s=WAIT_S,
    )
    reply: GrammarFetchReply = decode(raw.data, GrammarFetchReply)
    return reply


async def test_compiled_once_then_cached_and_shared_through_redis(
    replicas: tuple[Replica, Replica], bus: Bus, model_dir: Path
) -> None:
    from radixserve.model_files.tokenizer import tokenizer_id

    first, second = replicas
    tok = tokenizer_id(model_dir)
    source = json.dumps({**JSON_SCHEMAS[18], "title": uuid.uuid4().hex})  # new to Redis
    compiled = await _compile(bus, first, source, tokenizer=tok)
    assert (compiled.ok, compiled.cached) == (True, False), compiled
    assert compiled.key == grammar_key("json_schema", source, tok)
    again = await _compile(bus, first, source, tokenizer=tok)
    assert (again.ok, again.cached, again.key) == (True, True, compiled.key)
    # The other replica never compiled it: it comes from Redis.
    other = await _compile(bus, second, source, tokenizer=tok)
    assert (other.ok, other.cached, other.key) == (True, True, compiled.key)
    fetched = await _fetch(bus, second, compiled.key)
    assert fetched.ok and (fetched.kind, fetched.source, fetched.tokenizer_id) == (
        "json_schema",
        source,
        tok,
    )
    assert fetched.compiled is not None and fetched.compiled_format is not None
    _assert_artifact_constrains(fetched, model_dir)


def _assert_artifact_constrains(fetched: GrammarFetchReply, model_dir: Path) -> None:
    """The worker's view: the artifact loads without a compile and admits exactly what the
    schema admits (a valid document completes the grammar; a bad key is refused)."""
    import xgrammar as xgr

    from radixserve.grammar.artifact import deserialize
    from radixserve.grammar.compile import tokenizer_info
    from radixserve.model_files.config import ModelConfig
    from radixserve.model_files.tokenizer import load_tokenizer

    assert fetched.compiled is not None
    info = tokenizer_info(
        load_tokenizer(model_dir), ModelConfig.from_pretrained(model_dir).vocab_size
    )
    compiled = deserialize(fetched.compiled, info, fetched.compiled_format)
    document = {
        "id": 7,
        "customer": {"name": "Ada", "address": {"street": "1 Main St", "zip": "12345"}},
        "items": [{"sku": "AB123", "qty": 2}],
    }
    good = xgr.GrammarMatcher(compiled)
    assert good.accept_string(json.dumps(document))
    assert good.is_completed()
    bad = xgr.GrammarMatcher(compiled)
    assert not bad.accept_string('{"nope": 1}')


async def test_refusals_carry_a_code(
    replicas: tuple[Replica, Replica], bus: Bus, model_dir: Path
) -> None:
    from radixserve.model_files.tokenizer import tokenizer_id

    first, _ = replicas
    tok = tokenizer_id(model_dir)
    invalid = await _compile(bus, first, '{"type": "nonsense"}', tokenizer=tok)
    assert (invalid.ok, invalid.code) == (False, "invalid_grammar")
    assert invalid.error is not None and 'Unsupported type "nonsense"' in invalid.error
    regex = await _compile(bus, first, "[a-", kind="regex", tokenizer=tok)
    assert (regex.ok, regex.code) == (False, "invalid_grammar")
    # A grammar for another tokenizer: this replica cannot compile it (a 503 upstream).
    other = await _compile(bus, first, '{"type": "integer"}', tokenizer="tok-other")
    assert (other.ok, other.code) == (False, "grammar_unavailable")
    unknown = await _fetch(bus, first, "json_schema:" + "0" * 32)
    assert (unknown.ok, unknown.code) == (False, "unknown_key")


async def test_redis_grammar_cache_round_trip_and_a_dead_redis(redis_url: str) -> None:
    from radixserve.store.grammar_cache import RedisGrammarCache
    from radixserve.store.settings import StoreSettings

    prefix = f"t{uuid.uuid4().hex[:8]}:"
    cache = RedisGrammarCache(StoreSettings(url=redis_url, key_prefix=prefix), ttl_s=60)
    try:
        assert await cache.get("regex:k") is None
        await cache.put("regex:k", b"\x00\xffbinary")
        assert await cache.get("regex:k") == b"\x00\xffbinary"
        ttl = await cache._redis.pttl(cache.key("regex:k"))
        assert 0 < ttl <= 60_000 and cache.key("regex:k") == f"{prefix}grammar:regex:k"
        await cache.delete("regex:k")
    finally:
        await cache.close()
    # Nothing listens there: a miss within the timeout, then no waiting at all for a while.
    dead = RedisGrammarCache(StoreSettings(url="redis://127.0.0.1:9/0"), timeout_s=0.5)
    try:
        started = time.monotonic()
        assert await dead.get("regex:k") is None
        await dead.put("regex:k", b"x")
        assert await dead.get("regex:k") is None
        assert time.monotonic() - started < 1.5 and dead.failures == 1
    finally:
        await dead.close()


# -- the worker's side: a request waits for its grammar without holding others back ------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("grammar_worker_model"), seed=0)


@pytest.fixture(scope="module")
def worker(
    nats_url: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Subjects]:
    prefix = f"w{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("grammar_worker") / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "radixserve.cli", "serve", "worker"),
                *("--nats-url", nats_url, "--subject-prefix", prefix),
                *("--instance-id", "w0", "--model", str(tiny_dir), "--device", "cpu"),
                *("--max-total-tokens", "4096"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Subjects(prefix)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _routed(rid: str, key: str | None, **sampling: Any) -> bytes:
    from radixserve.protocol import RoutedRequest, SamplingParams, TokenizedRequest, pack_tokens

    request = TokenizedRequest(
        rid=rid,
        gateway_id="gw",
        input_ids=pack_tokens([5, 6, 7, 8]),
        sampling=SamplingParams(temperature=0.0, **sampling),
        grammar_key=key,
    )
    return encode(RoutedRequest(request=request, worker_id="w0"))


async def test_worker_waits_for_grammars_off_the_engine_and_answers_aborts(
    worker: Subjects, bus: Bus, tiny_dir: Path
) -> None:
    from radixserve.grammar.compile import XGrammarCompiler
    from radixserve.grammar.registry import GrammarRegistry, entry_builder
    from radixserve.model_files.config import ModelConfig
    from radixserve.model_files.tokenizer import load_tokenizer
    from radixserve.protocol import AbortRequest, Heartbeat, StepOutputBatch, WorkerStatus

    # The test is the grammar service: it answers fetches late, with a real artifact.
    compiler = XGrammarCompiler.for_tokenizer(
        load_tokenizer(tiny_dir), ModelConfig.from_pretrained(tiny_dir).vocab_size
    )
    registry = GrammarRegistry(build=entry_builder(compiler, "tok"), tokenizer_id="tok")
    schema = json.dumps(JSON_SCHEMAS[9])
    key = (
        await registry.compile(
            GrammarCompileRequest(rid="c", kind="json_schema", source=schema, tokenizer_id="tok")
        )
    ).key
    delays = {"slow": 2.0, "aborted": 30.0}

    async def on_fetch(msg: BusMsg) -> None:
        request = decode(msg.data, GrammarFetchRequest)
        await asyncio.sleep(delays.get(request.rid, 0.0))
        await bus.respond(msg, encode(await registry.fetch(request)))

    finished: dict[str, tuple[float, str, list[int]]] = {}
    tokens: dict[str, list[int]] = {}

    async def on_detok(msg: BusMsg) -> None:
        from radixserve.protocol import unpack_tokens

        for out in decode(msg.data, StepOutputBatch).outputs:
            tokens.setdefault(out.rid, []).extend(unpack_tokens(out.new_token_ids))
            if out.finish_reason is not None:
                finished[out.rid] = (time.monotonic(), out.finish_reason.kind, tokens[out.rid])

    ready = asyncio.Event()

    async def on_beat(msg: BusMsg) -> None:
        if decode(msg.data, Heartbeat).status is WorkerStatus.READY:
            ready.set()

    await bus.subscribe(worker.grammar_fetch, on_fetch)
    await bus.subscribe(worker.detok, on_detok)
    await bus.subscribe(worker.heartbeat("w0"), on_beat)
    await asyncio.wait_for(ready.wait(), 90)

    await bus.publish(
        worker.worker_run("w0"), _routed("slow", key, json_schema=schema, max_new_tokens=200)
    )
    await bus.publish(worker.worker_run("w0"), _routed("aborted", key + "x", json_schema=schema))
    await bus.publish(worker.worker_run("w0"), _routed("free", None, max_new_tokens=4))
    await asyncio.sleep(0.5)
    await bus.publish(worker.worker_abort("w0"), encode(AbortRequest(rid="aborted")))
    deadline = time.monotonic() + 60
    while len(finished) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert set(finished) == {"slow", "aborted", "free"}, finished
    # The unconstrained request did not wait for the grammar of the one before it.
    assert finished["free"][0] < finished["slow"][0]
    assert finished["aborted"][1] == "abort" and finished["aborted"][2] == []
    assert finished["slow"][1] == "stop"
    text = load_tokenizer(tiny_dir).decode(finished["slow"][2], skip_special_tokens=True)
    check_json(text, JSON_SCHEMAS[9])
    await registry.close()
