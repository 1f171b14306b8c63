"""radixserve.bus against a real nats-server: pub/sub, queue groups, request/reply,
timeouts, trace context in headers, and surviving a server restart."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from radixserve.bus import (
    TRACEPARENT,
    Bus,
    BusConnectError,
    BusMsg,
    BusNoResponders,
    BusSettings,
    BusTimeout,
    Handler,
    extract_trace,
)
from radixserve.infra import NatsServer, free_port

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


def _subject(name: str) -> str:
    # The session server is shared: unique subjects keep tests apart.
    return f"test.{name}.{uuid.uuid4().hex[:8]}"


async def _connect(url: str, reconnect_time_wait_s: float = 0.25) -> Bus:
    settings = BusSettings(url=url, name="test-bus", reconnect_time_wait_s=reconnect_time_wait_s)
    return await Bus.connect(settings)


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    client = await _connect(nats_url)
    yield client
    await client.close()


def _collector() -> tuple[asyncio.Queue[BusMsg], Handler]:
    received: asyncio.Queue[BusMsg] = asyncio.Queue()

    async def handler(msg: BusMsg) -> None:
        received.put_nowait(msg)

    return received, handler


async def test_publish_subscribe_carries_bytes_and_headers(bus: Bus) -> None:
    subject = _subject("pubsub")
    received, handler = _collector()
    await bus.subscribe(subject, handler)
    payload = bytes(range(256))
    await bus.publish(subject, payload, headers={"rid": "r-1"})
    msg = await asyncio.wait_for(received.get(), WAIT_S)
    assert msg.subject == subject
    assert msg.data == payload
    assert msg.headers["rid"] == "r-1"


async def test_queue_group_shares_load_without_duplicates(nats_url: str, bus: Bus) -> None:
    subject = _subject("queue")
    workers = [await _connect(nats_url) for _ in range(2)]
    seen: list[list[int]] = [[], []]

    def make_handler(index: int) -> Handler:
        async def handler(msg: BusMsg) -> None:
            seen[index].append(int(msg.data))

        return handler

    async def wait_delivered(count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(seen[0]) + len(seen[1]) < count:
            assert time.monotonic() < deadline, (
                f"{len(seen[0]) + len(seen[1])} of {count} delivered"
            )
            await asyncio.sleep(0.02)

    sent = 0
    try:
        for index, worker in enumerate(workers):
            await worker.subscribe(subject, make_handler(index), queue="workers")
        # NOTE: nats-server 2.15 may route a publisher's first burst right after a
        # member joins all to one member, so publish in batches until both get some.
        while not (seen[0] and seen[1]) and sent < 2000:
            for _ in range(50):
                await bus.publish(subject, str(sent).encode())
                sent += 1
            await wait_delivered(sent)
        await asyncio.sleep(0.1)  # a duplicate would arrive right behind
    finally:
        for worker in workers:
            await worker.close()
    assert seen[0] and seen[1], f"one member got all {sent} messages"
    assert sorted(seen[0] + seen[1]) == list(range(sent)), "each message exactly once"


async def test_request_reply(bus: Bus) -> None:
    subject = _subject("echo")

    async def reverse(msg: BusMsg) -> None:
        await bus.respond(msg, msg.data[::-1], headers={"served-by": "reverse"})

    await bus.subscribe(subject, reverse)
    reply = await bus.request(subject, b"abc", timeout_s=WAIT_S)
    assert reply.data == b"cba"
    assert reply.headers["served-by"] == "reverse"


async def test_request_timeout_raises_bus_timeout(bus: Bus) -> None:
    subject = _subject("silent")
    _, handler = _collector()  # subscribed, so the server sees a responder, but no reply
    await bus.subscribe(subject, handler)
    started = time.monotonic()
    with pytest.raises(BusTimeout) as info:
        await bus.request(subject, b"?", timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 3.0
    assert info.value.subject == subject


async def test_request_without_responders_fails_fast(bus: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(BusNoResponders):
        await bus.request(_subject("nobody"), b"?", timeout_s=5.0)
    assert time.monotonic() - started < 2.0


async def test_traceparent_propagates_across_a_request(bus: Bus) -> None:
    subject = _subject("traced")
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    parent = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(1))
    seen: list[tuple[str, SpanContext]] = []

    async def responder(msg: BusMsg) -> None:
        remote = trace.get_current_span(extract_trace(msg.headers)).get_span_context()
        seen.append((msg.headers[TRACEPARENT], remote))
        # The handler runs in the sender's context, so the reply continues the trace.
        assert trace.get_current_span().get_span_context().trace_id == trace_id
        await bus.respond(msg, b"ok")

    await bus.subscribe(subject, responder)
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    try:
        reply = await bus.request(subject, b"x", timeout_s=WAIT_S)
    finally:
        otel_context.detach(token)

    header, remote = seen[0]
    assert header == f"00-{trace_id:032x}-{span_id:016x}-01"  # W3C format
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (trace_id, span_id, True)
    reply_ctx = trace.get_current_span(extract_trace(reply.headers)).get_span_context()
    assert reply_ctx.trace_id == trace_id


async def test_no_traceparent_without_an_active_span(bus: Bus) -> None:
    subject = _subject("untraced")
    received, handler = _collector()
    await bus.subscribe(subject, handler)
    await bus.publish(subject, b"x")
    msg = await asyncio.wait_for(received.get(), WAIT_S)
    assert TRACEPARENT not in msg.headers


async def test_health_and_close(nats_url: str) -> None:
    client = await _connect(nats_url)
    health = await client.health()
    assert health.ok and health.connected and health.rtt_s is not None and health.rtt_s < 1.0
    await client.drain()
    after = await client.health()
    assert not after.ok and not after.connected


async def test_payload_must_be_bytes(bus: Bus) -> None:
    with pytest.raises(TypeError, match="bytes"):
        await bus.publish(_subject("typed"), "text")  # type: ignore[arg-type]


async def test_connect_gives_up_after_bounded_attempts() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(BusConnectError, match="2 attempts"):
        await Bus.connect(
            BusSettings(url=url, connect_attempts=2, connect_timeout_s=0.3, connect_backoff_s=0.05)
        )
    assert time.monotonic() - started < 3.0


async def test_reconnects_after_server_restart(private_nats: NatsServer) -> None:
    client = await _connect(private_nats.url, reconnect_time_wait_s=0.1)
    try:
        subject = _subject("survivor")
        received, handler = _collector()
        await client.subscribe(subject, handler)
        await client.publish(subject, b"before")
        assert (await asyncio.wait_for(received.get(), WAIT_S)).data == b"before"

        private_nats.kill()  # SIGKILL: a crash, not a clean shutdown
        deadline = time.monotonic() + WAIT_S
        while client.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not client.is_connected, "the client should notice the dead server"

        private_nats.start()  # same port
        assert await client.wait_connected(timeout_s=10.0)
        assert client.reconnects >= 1
        assert (await client.health()).ok  # round trip: the replayed SUB is in place

        # From another connection, so delivery depends on the server-side subscription.
        other = await _connect(private_nats.url)
        try:
            await other.publish(subject, b"after")
            await other.health()
        finally:
            await other.close()
        assert (await asyncio.wait_for(received.get(), WAIT_S)).data == b"after"
    finally:
        await client.close()
