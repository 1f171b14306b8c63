"""`radixserve up`'s supervisor restarts the NATS and Redis it started as it does the
services: a SIGKILLed nats-server comes back on its port with its JetStream store, and a
restart that fails (the port taken meanwhile) is announced and tried again, the store
kept. Real nats-server processes."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import nats
import pytest

from radixserve.infra import NatsServer, free_port
from radixserve.infra.servers import ephemeral_ports_start
from radixserve.stack import BACKOFF_START_S, Stack, StackSpec, Supervised

pytestmark = pytest.mark.timeout(120)

STREAM = "kept"


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


async def _add_stream(url: str) -> None:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        await nc.jetstream().add_stream(name=STREAM, subjects=[f"{STREAM}.>"])
        await nc.jetstream().publish(f"{STREAM}.a", b"survives", timeout=5)
    finally:
        await nc.close()


async def _stream_messages(url: str) -> int:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream().stream_info(STREAM)
        return int(info.state.messages)
    finally:
        await nc.close()


def _supervise_until_alive(stack: Stack, server: NatsServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.alive and time.monotonic() < deadline:
        stack.supervise_once()
        time.sleep(0.1)


def test_killed_nats_comes_back_on_its_port_with_its_store(tmp_path: Path) -> None:
    said: list[str] = []
    stack = Stack(_spec(tmp_path), say=said.append)
    with NatsServer() as server:
        assert isinstance(server, NatsServer)
        asyncio.run(_add_stream(server.url))
        stack.adopt([server])
        port, workdir, old_pid = server.port, server.workdir, server.pid

        server.kill()
        _supervise_until_alive(stack, server, timeout_s=30)

        assert server.alive and server.pid != old_pid
        assert server.port == port and server.workdir == workdir
        assert asyncio.run(_stream_messages(server.url)) == 1  # the JetStream store was kept
        text = "\n".join(said)
        assert "nats-server exited; restarting in 1s" in text
        assert f"nats-server restarted (restart 1, pid {server.pid})" in text
        assert stack.servers[0].restarts == 1


def test_failed_restart_keeps_the_store_and_tries_again_later(tmp_path: Path) -> None:
    said: list[str] = []
    with NatsServer(startup_timeout_s=5) as server:
        assert isinstance(server, NatsServer)
        asyncio.run(_add_stream(server.url))
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

        assert server.alive and item.restarts == 1
        assert asyncio.run(_stream_messages(server.url)) == 1


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    # Outgoing connections take their local port from that range; a server there could
    # find its port taken when it restarts.
    assert all(free_port() < ephemeral_ports_start() for _ in range(20))
