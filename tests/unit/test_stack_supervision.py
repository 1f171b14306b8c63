"""`radixserve up`'s supervisor restarts the NATS and Redis it started as it does the
services: a SIGKILLed nats-server comes back on its port, where a client that was
subscribed reconnects and receives again, and a restart that fails (the port taken
meanwhile) is announced and tried again on the same port. Real nats-server processes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pytest

from radixserve.infra import NatsServer, free_port
from radixserve.infra.servers import ephemeral_ports_start
from radixserve.stack import BACKOFF_START_S, Stack, StackSpec, Supervised

pytestmark = pytest.mark.timeout(120)

SUBJECT = "p.check"


def _spec(tmp_path: Path) -> StackSpec:
    return StackSpec(
        nats_url="nats://unused",
        redis_url="redis://unused",
        subject_prefix="p",
        host="127.0.0.1",
        port=0,
        workers=1,
        model_dir=tmp_path,
        served_model_name="m",
        worker_args=[],
        tokenizer_args=[],
        log_dir=tmp_path,
    )


async def _round_trip(url: str) -> bytes:
    """What a new client's subscription receives of its own publish."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        sub = await nc.subscribe(SUBJECT)
        await nc.publish(SUBJECT, b"up")
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


async def _received_across(url: str, restart: Callable[[], None]) -> bytes:
    """A client subscribed before `restart` (run in a thread, the client's loop going on),
    reconnecting as the services do: what its subscription receives afterwards."""
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(
        url,
        connect_timeout=5,
        reconnect_time_wait=0.25,
        max_reconnect_attempts=-1,
        reconnected_cb=on_reconnect,
    )
    try:
        sub = await nc.subscribe(SUBJECT)
        await nc.flush()
        await asyncio.to_thread(restart)
        await asyncio.wait_for(reconnected.wait(), timeout=30)
        await nc.publish(SUBJECT, b"again")  # after the replayed SUB, on one connection
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


def _supervise_until_alive(stack: Stack, server: NatsServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.alive and time.monotonic() < deadline:
        stack.supervise_once()
        time.sleep(0.1)


def test_killed_nats_comes_back_on_its_port_and_clients_reconnect(tmp_path: Path) -> None:
    said: list[str] = []
    stack = Stack(_spec(tmp_path), say=said.append)
    with NatsServer() as server:
        assert isinstance(server, NatsServer)
        stack.adopt([server])
        port, workdir, old_pid = server.port, server.workdir, server.pid

        def crash_and_supervise() -> None:
            server.kill()
            _supervise_until_alive(stack, server, timeout_s=30)

        assert asyncio.run(_received_across(server.url, crash_and_supervise)) == b"again"
        assert server.alive and server.pid != old_pid
        assert server.port == port and server.workdir == workdir
        text = "\n".join(said)
        assert "nats-server exited; restarting in 1s" in text
        assert f"nats-server restarted (restart 1, pid {server.pid})" in text
        assert stack.servers[0].restarts == 1


def test_failed_restart_is_announced_and_tried_again_later(tmp_path: Path) -> None:
    said: list[str] = []
    with NatsServer(startup_timeout_s=5) as server:
        assert isinstance(server, NatsServer)
        port = server.port
        item = Supervised(server.name, server, started_at=time.monotonic())
        server.kill()
        with socket.socket() as squatter:  # takes the port while the server is down
            squatter.bind((server.host, server.port))
            squatter.listen()
            item.supervise(time.monotonic(), said.append)  # notices the exit
            item.supervise(time.monotonic() + BACKOFF_START_S, said.append)  # fails
        assert not server.alive and item.restarts == 0
        assert "nats-server did not restart; next try in 2s" in "\n".join(said)
        assert item.restart_at is not None and item.backoff_s == 4 * BACKOFF_START_S

        item.supervise(item.restart_at, said.append)

        assert server.alive and item.restarts == 1 and server.port == port
        assert asyncio.run(_round_trip(server.url)) == b"up"


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    # Outgoing connections take their local port from that range; a server there could
    # find its port taken when it restarts.
    assert all(free_port() < ephemeral_ports_start() for _ in range(20))
