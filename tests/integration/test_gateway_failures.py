"""The gateway when things fail: SIGTERM drain with Redis down, NATS down and back,
and the Redis record writer on its own (never blocks the request path)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest

from radixserve.bus import Bus, BusMsg
from radixserve.infra import NatsServer, RedisServer, free_port
from radixserve.protocol import (
    AbortRequest,
    InflightQuery,
    InflightReply,
    Subjects,
    SubmitRequest,
    decode,
    encode,
)
from radixserve.services.gateway.records import RecordWriter
from radixserve.store import Store, StoreSettings
from radixserve.telemetry import GatewayMetrics
from tests.fixtures.gateway import (
    WAIT_S,
    FakePipeline,
    expected_text,
    start_gateway,
)

pytestmark = pytest.mark.timeout(60)


# -- drain --------------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_requests_then_exits_with_redis_down(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Redis is down for this gateway: requests are served all the same.
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    gen = start_gateway(nats_url, dead_redis, tmp_path / "drain.log")
    gateway = next(gen)
    bus = await Bus.connect(nats_url)
    fake = FakePipeline(bus, Subjects(gateway.prefix))
    try:
        await fake.start()
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            slow = asyncio.create_task(http.post("/v1/completions", json={"prompt": "slow"}))
            await fake.next_submit()
            # Its record write waits for Redis (kept, retried); reading records is a 503.
            record = await http.get("/v1/requests/anything")
            assert record.status_code == 503
            assert record.json()["error"]["code"] == "store_unavailable"
            gateway.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + WAIT_S
            while True:  # new requests are refused while the slow one finishes
                refused = await http.post("/v1/completions", json={"prompt": "late"})
                if refused.status_code == 503:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert refused.json()["error"]["code"] == "draining"
            finished = await slow
        assert finished.status_code == 200, finished.text
        assert finished.json()["choices"][0]["text"] == expected_text("slow", 0, 4)
        # It waits up to its flush timeout (10 s) for Redis to take the records, then exits.
        code = await asyncio.to_thread(gateway.proc.wait, 30)
        assert code == 0, gateway.log()
    finally:
        await bus.close()
        gen.close()
        if os.environ.get("RADIXSERVE_TEST_SHOW_LOGS"):
            print(gateway.log())


async def test_nats_down_is_503_and_recovers(
    private_nats: NatsServer, redis_url: str, tmp_path: Path
) -> None:
    gen = start_gateway(private_nats.url, redis_url, tmp_path / "nats_down.log")
    gateway = next(gen)
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            private_nats.kill()
            deadline = time.monotonic() + WAIT_S
            while (await http.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.05)
            refused = await http.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_bus"
            assert refused.headers["retry-after"] == "1"
            private_nats.start()
            deadline = time.monotonic() + WAIT_S
            # Back on the bus: not "no_bus" (it is not ready: nothing else runs here).
            while (await http.get("/health")).json()["status"] == "no_bus":
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.05)
    finally:
        gen.close()


# -- acknowledged submits ---------------------------------------------------------------------


async def test_a_request_no_tokenizer_acknowledges_is_503_not_a_wait_for_the_timeout(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    # The request timeout (60 s) is far past the client's (WAIT_S): a request left
    # waiting would fail the test with a read timeout.
    flags = ("--request-timeout-s", "60", "--submit-ack-timeout-s", "0.5")
    gen = start_gateway(nats_url, redis_url, tmp_path / "ack.log", *flags)
    gateway = next(gen)
    bus = await Bus.connect(nats_url)
    subjects = Subjects(gateway.prefix)
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            # No tokenizer under this prefix: NATS says so at once.
            refused = await http.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "no_tokenizer"
            assert refused.headers["retry-after"] == "1"
            # A tokenizer that takes requests but never acknowledges (a lost message
            # looks the same): 503 after the ack timeout, and the request is aborted.
            submits: asyncio.Queue[SubmitRequest] = asyncio.Queue()
            aborts: asyncio.Queue[AbortRequest] = asyncio.Queue()

            async def swallow(msg: BusMsg) -> None:
                submits.put_nowait(decode(msg.data, SubmitRequest))

            async def on_abort(msg: BusMsg) -> None:
                aborts.put_nowait(decode(msg.data, AbortRequest))

            await bus.subscribe(subjects.tokenize, swallow, queue="tokenizer")
            await bus.subscribe(subjects.abort, on_abort, queue="scheduler")
            body = {"model": "test-model", "messages": [{"role": "user", "content": "y"}]}
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "tokenizer_unresponsive"
            assert "within 0.5 s" in error["message"]
            submit = submits.get_nowait()

            async def abort_of(rid: str) -> AbortRequest:
                # The first request's abort may reach NATS after the subscription did.
                while (abort := await aborts.get()).rid != rid:
                    pass
                return abort

            abort = await asyncio.wait_for(abort_of(submit.rid), WAIT_S)
            assert abort.rid == submit.rid == refused.headers["x-request-id"]
    finally:
        await bus.close()
        gen.close()


async def test_a_request_whose_end_was_lost_is_503_not_a_wait_for_the_timeout(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    # "hang": the fake pipeline takes the request and sends nothing back, as when its
    # last output was lost on the way. A fake scheduler answers the gateway's question.
    flags = ("--request-timeout-s", "60", "--lost-check-s", "1")
    gen = start_gateway(nats_url, redis_url, tmp_path / "lost.log", *flags)
    gateway = next(gen)
    bus = await Bus.connect(nats_url)
    subjects = Subjects(gateway.prefix)
    fake = FakePipeline(bus, subjects)
    inflight: set[str] = set()
    ended: dict[str, float] = {}  # rid -> when it ended (monotonic)
    queries: list[InflightQuery] = []

    async def on_query(msg: BusMsg) -> None:
        query = decode(msg.data, InflightQuery)
        queries.append(query)
        now = time.monotonic()
        reply = InflightReply(
            inflight=[rid for rid in query.rids if rid in inflight],
            ended={rid: now - ended[rid] for rid in query.rids if rid in ended},
        )
        await bus.respond(msg, encode(reply))

    try:
        await fake.start()
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            # No scheduler answers yet: the request just waits.
            waiting = asyncio.create_task(http.post("/v1/completions", json={"prompt": "hang"}))
            rid = (await fake.next_submit()).rid
            await asyncio.sleep(2.5)
            await bus.subscribe(subjects.scheduler_inflight, on_query, queue="scheduler")
            # In flight at the scheduler (queued or running at a worker): it waits on.
            inflight.add(rid)
            await asyncio.sleep(2.5)
            assert queries and queries[-1].rids == [rid] and not waiting.done()
            # Unknown to the scheduler (still at the tokenizer, or before its restart).
            inflight.clear()
            await asyncio.sleep(2.5)
            assert not waiting.done()
            # Ended long enough ago (half the silence) that its end is not on its way.
            ended[rid] = time.monotonic()
            lost = await asyncio.wait_for(waiting, WAIT_S)
            assert time.monotonic() - ended[rid] >= 0.5
            assert lost.status_code == 503, lost.text
            error = lost.json()["error"]
            assert error["code"] == "request_lost" and lost.headers["retry-after"] == "1"
            abort = await asyncio.wait_for(fake.aborts.get(), WAIT_S)
            assert abort.rid == rid
            # Requests that answer are untouched.
            ok = await http.post("/v1/completions", json={"prompt": "hi"})
            assert ok.status_code == 200, ok.text
    finally:
        await bus.close()
        gen.close()


# -- the record writer on its own: Redis slow or down never blocks the request path ------------


def failures(metrics: GatewayMetrics) -> float | None:
    return metrics.registry.get_sample_value("radixserve:store_write_failures_total")


async def test_record_writer_writes_in_order(
    redis_url: str,
) -> None:
    metrics = GatewayMetrics()
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = Store(StoreSettings(url=redis_url, key_prefix=prefix))
    writer = RecordWriter(store, ttl_s=60, metrics=metrics)
    task = asyncio.create_task(writer.run())
    try:
        writer.put("r1", {"state": "received", "n": 1})
        writer.update("r1", {"state": "finished", "prompt_tokens": 4, "finished_at": 1.5})
        writer.update("ghost", {"state": "finished"})  # no record: nothing written
        assert await writer.flush(timeout_s=5.0)
        record = await writer.get("r1")
        assert record == {
            "id": "r1",
            "state": "finished",
            "n": 1,
            "prompt_tokens": 4,
            "finished_at": 1.5,
        }
        assert await writer.get("ghost") is None
        ttl = await store.request_ttl_s("r1")
        assert ttl is not None and 0 < ttl <= 60
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.delete_request("r1")
        await store.close()
    assert failures(metrics) == 0


async def test_record_writes_wait_out_a_redis_outage_in_a_bounded_queue() -> None:
    """Redis away: the caller never waits, what the queue has no room for is dropped at
    once, and the rest is written, in order, once Redis is back on its port."""
    metrics = GatewayMetrics()
    port = free_port()
    away = Store(
        StoreSettings(
            url=f"redis://127.0.0.1:{port}/0", connect_timeout_s=0.2, socket_timeout_s=0.2
        )
    )
    writer = RecordWriter(away, ttl_s=60, metrics=metrics, max_pending=3, write_timeout_s=0.5)
    task = asyncio.create_task(writer.run())
    try:
        started = time.monotonic()
        for i in range(5):  # three queued, two dropped at once
            writer.put(f"r{i}", {"state": "received"})
        writer.update("r0", {"state": "finished"})  # joins r0's queued put
        assert time.monotonic() - started < 0.05
        assert failures(metrics) == 2
        await asyncio.sleep(1.5)  # some retries fail meanwhile: nothing more is dropped
        assert failures(metrics) == 2 and writer.pending == 3
        writer.update("r1", {"state": "running"})  # r1's put is retried, this joins it
        with RedisServer(port=port):
            assert await writer.flush(timeout_s=15.0)
            assert (await writer.get("r0") or {}).get("state") == "finished"
            assert (await writer.get("r1") or {}).get("state") == "running"
            assert (await writer.get("r2") or {}).get("state") == "received"
            assert await writer.get("r3") is None and await writer.get("r4") is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await away.close()
    assert failures(metrics) == 2


async def test_record_writes_queued_for_one_record_join(redis_url: str) -> None:
    """A write of a record that still has one queued joins it: one Redis call, the same
    record as the writes one after the other would leave."""
    metrics = GatewayMetrics()
    store = Store(StoreSettings(url=redis_url, key_prefix=f"test-{uuid.uuid4().hex[:8]}:"))
    writer = RecordWriter(store, ttl_s=60, metrics=metrics)
    writer.put("r1", {"state": "received", "n": 1, "received_at": 1.0})
    writer.update("r1", {"state": "queued", "queued_at": 2.0})
    writer.update("r1", {"worker": "w-0"})
    writer.update("r2", {"state": "finished"})  # before its put: on its own, nothing
    writer.put("r2", {"state": "received", "n": 2})  # ... and a put replaces it
    writer.update("ghost", {"state": "finished"})
    assert writer.pending == 3
    task = asyncio.create_task(writer.run())
    try:
        assert await writer.flush(timeout_s=5.0)
        writer.update("r1", {"state": "finished"})  # the first was taken: a write of its own
        assert await writer.flush(timeout_s=5.0)
        assert await writer.get("r1") == {
            "id": "r1",
            "state": "finished",
            "n": 1,
            "received_at": 1.0,
            "queued_at": 2.0,
            "worker": "w-0",
        }
        assert await writer.get("r2") == {"id": "r2", "state": "received", "n": 2}
        assert await writer.get("ghost") is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for rid in ("r1", "r2"):
            await store.delete_request(rid)
        await store.close()
    assert failures(metrics) == 0
