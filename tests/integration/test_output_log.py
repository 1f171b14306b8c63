"""The output log (store/output_log.py) and the gateway's replay of it (gateway/resume.py)
against a real redis-server: numbering, TTL, a live tail, a gap, a failure, no Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from radixserve.api import ApiError, CompletionRequest, parse_body, plan_completion
from radixserve.api.limits import DEFAULT_LIMITS
from radixserve.infra import free_port
from radixserve.protocol import FinishReason, TextDelta, encode_json, pack_tokens
from radixserve.services.gateway.resume import Replay, ResumePoint, plan_of, record_fields
from radixserve.store import Store, StoreSettings
from radixserve.store.output_log import LogEntry, OutputLog, OutputLogWriter

pytestmark = pytest.mark.timeout(30)

WORDS = [f" w{i}" for i in range(12)]


def plan(rid: str) -> Any:
    raw = b'{"model": "m", "prompt": "hi", "max_tokens": 12, "stream": true}'
    return plan_completion(
        parse_body(CompletionRequest, raw),
        response_id=rid,
        gateway_id="g1",
        served_model="m",
        arrival_time=time.time(),
        limits=DEFAULT_LIMITS,
    )


def deltas(rid: str) -> list[TextDelta]:
    out = []
    for i, word in enumerate(WORDS):
        last = i == len(WORDS) - 1
        out.append(
            TextDelta(
                rid=rid,
                text=word,
                token_ids=pack_tokens([100 + i]),
                prompt_tokens=2,
                completion_tokens=i + 1,
                finish_reason=FinishReason(kind="length") if last else None,
            )
        )
    return out


def replay_of(
    output_log: OutputLog, rid: str, offset: int, record: dict[str, Any] | None = None
) -> Replay:
    async def record_now() -> dict[str, Any] | None:
        return record

    return Replay(
        output_log,
        plan(rid),
        ResumePoint(rid, (offset,)),
        created=1,
        received_at=time.time(),
        timeout_s=20,
        record_state=record_now,
    )


async def collect(replay: Replay) -> tuple[list[str], list[str]]:
    """(texts replayed, texts to send) until the request is done."""
    replayed: list[str] = []
    sent: list[str] = []
    while not replay.assembly.done:
        update = await replay.next_update()
        (replayed if replay.replaying else sent).append(update.choice.text[-3:])
    return replayed, sent


async def test_writer_numbers_each_request_and_renews_the_ttl(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    dropped: list[int] = []
    writer = OutputLogWriter(output_log, on_dropped=dropped.append)
    task = asyncio.create_task(writer.run())
    try:
        writer.put(
            [LogEntry("a", writer.number("a"), "x0"), LogEntry("b", writer.number("b"), "y0")]
        )
        writer.put([LogEntry("a", writer.number("a"), "x1")])
        assert await writer.flush(5)
        await asyncio.sleep(0.2)  # the last batch taken is written
        found = await output_log.read({"a": "0", "b": "0"})
    finally:
        task.cancel()
    assert [(e.seq, e.delta) for e in found["a"]] == [(0, "x0"), (1, "x1")]
    assert [(e.seq, e.delta) for e in found["b"]] == [(0, "y0")]
    assert 0 < await store.redis.pttl(output_log.key("a")) <= 30_000
    assert dropped == []
    after = await output_log.read({"a": found["a"][-1].entry_id})
    assert after == {}


async def test_a_replay_skips_what_the_client_has_and_tails_the_rest(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    written = deltas(rid)

    async def produce() -> None:  # the detokenizer, writing as the request runs
        for seq, delta in enumerate(written):
            await output_log.append([LogEntry(rid, seq, encode_json(delta))])
            await asyncio.sleep(0.05)

    producer = asyncio.create_task(produce())
    replayed, sent = await collect(replay_of(output_log, rid, offset=5))
    await producer
    assert replayed == [w[-3:] for w in WORDS[:5]]
    assert sent == [w[-3:] for w in WORDS[5:]]


async def test_a_gap_in_the_log_refuses_the_resume(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    kept = [d for i, d in enumerate(deltas(rid)) if i != 3]
    seqs = [i for i in range(len(WORDS)) if i != 3]
    await output_log.append(
        [LogEntry(rid, seq, encode_json(d)) for seq, d in zip(seqs, kept, strict=True)]
    )
    with pytest.raises(ApiError) as refused:
        await collect(replay_of(output_log, rid, offset=1))
    assert (refused.value.status, refused.value.code) == (410, "output_incomplete")


async def test_a_request_that_failed_ends_its_replay_with_its_error(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    first = deltas(rid)[:2]
    await output_log.append([LogEntry(rid, i, encode_json(d)) for i, d in enumerate(first)])
    failed = {"state": "failed", "http_status": 503, "error_code": "worker_lost"}
    with pytest.raises(ApiError) as ended:
        await collect(replay_of(output_log, rid, offset=2, record=failed))
    assert (ended.value.status, ended.value.code) == (503, "worker_lost")


async def test_a_finished_request_whose_log_expired_is_410(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    with pytest.raises(ApiError) as gone:
        await collect(replay_of(output_log, rid, offset=0, record={"state": "finished"}))
    assert (gone.value.status, gone.value.code) == (410, "output_expired")


def test_the_record_keeps_the_plan_without_its_prompt() -> None:
    original = plan("cmpl-1")
    fields = record_fields(original, created=123)
    assert "hi" not in str(fields["plan"])
    record = {**fields, "id": "cmpl-1"}
    rebuilt, created = plan_of(record)
    assert created == 123 and rebuilt.rids == original.rids and rebuilt.stream
    assert rebuilt.submits[0].sampling == original.submits[0].sampling


async def test_the_writer_never_waits_for_a_redis_that_is_not_there() -> None:
    absent = Store(StoreSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    dropped: list[int] = []
    writer = OutputLogWriter(
        OutputLog(absent), on_dropped=dropped.append, max_pending=2, write_timeout_s=0.5
    )
    task = asyncio.create_task(writer.run())
    try:
        started = time.monotonic()
        for i in range(10):
            writer.put([LogEntry("a", writer.number("a"), f"x{i}")])
        assert time.monotonic() - started < 0.1
        deadline = time.monotonic() + 10
        while sum(dropped) < 10:
            assert time.monotonic() < deadline, dropped
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await absent.close()
    assert sum(dropped) == 10
