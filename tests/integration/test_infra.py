"""The launcher (radixserve.infra) against the real binaries: it serves NATS and Redis
(neither keeping anything on disk), stops them on SIGINT, leaks nothing when SIGKILLed,
and says clearly what is wrong when a binary is bad."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
import redis.asyncio as aioredis

from radixserve.infra import Infra, InfraError, InfraSettings, NatsServer, free_port
from radixserve.infra.settings import ENV_NATS_URL, ENV_REDIS_URL

pytestmark = pytest.mark.timeout(60)

_LINE = re.compile(r"^(nats-server|redis-server) pid=(\d+) url=(\S+)$")


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    pids: dict[str, int]
    urls: dict[str, str]


def _launcher_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_NATS_URL, ENV_REDIS_URL)}
    # Work dirs land in pytest's tmp dir, so a SIGKILLed launcher leaves nothing in /tmp.
    env["TMPDIR"] = str(tmp)
    return env


# The module form, and the `radixserve infra` command users type (same launcher behind).
LAUNCHERS = {
    "module": [sys.executable, "-m", "radixserve.infra"],
    "cli": [sys.executable, "-m", "radixserve.cli", "infra"],
}


def _launch(tmp: Path, timeout_s: float = 20.0, how: str = "module") -> Launched:
    """Run the launcher and read its pid/url lines up to `ready`."""
    proc = subprocess.Popen(
        LAUNCHERS[how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_launcher_env(tmp),
    )
    stdout = proc.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # a thread, so each read below can have a timeout
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    pids: dict[str, int] = {}
    urls: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            proc.kill()
            pytest.fail("launcher did not print `ready` in time")
        try:
            line = lines.get(timeout=remaining).strip()
        except queue.Empty:
            continue
        if line == "ready":
            return Launched(proc, pids, urls)
        match = _LINE.match(line)
        if match:
            pids[match[1]] = int(match[2])
            urls[match[1]] = match[3]


def _pid_alive(pid: int) -> bool:
    """Running, not a zombie (an unreaped child of a dead parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _pid_alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if _pid_alive(pid)]


async def _exercise_nats(url: str) -> None:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        sub = await nc.subscribe("infra.test")
        await nc.publish("infra.test", b"hello")
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"hello"

        # Started without JetStream: nobody answers its API.
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request("$JS.API.INFO", b"", timeout=2)
    finally:
        await nc.close()


async def _exercise_redis(url: str) -> None:
    client = aioredis.Redis.from_url(url, socket_timeout=2)
    try:
        await client.set("infra:k", "v")
        assert await client.get("infra:k") == b"v"
        assert await client.incrby("infra:n", 5) == 5
        # Started without persistence.
        assert (await client.config_get("save"))["save"] == ""
        assert (await client.config_get("appendonly"))["appendonly"] == "no"
    finally:
        await client.aclose()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("how", sorted(LAUNCHERS))
async def test_launcher_serves_both_and_stops_them_on_sigint(tmp_path: Path, how: str) -> None:
    launched = _launch(tmp_path, how=how)
    try:
        assert set(launched.pids) == {"nats-server", "redis-server"}
        assert all(_pid_alive(pid) for pid in launched.pids.values())
        await _exercise_nats(launched.urls["nats-server"])
        await _exercise_redis(launched.urls["redis-server"])
    finally:
        launched.proc.send_signal(signal.SIGINT)
        rc = launched.proc.wait(timeout=15)
    assert rc == 0, launched.proc.stderr.read() if launched.proc.stderr else ""
    assert _wait_gone(list(launched.pids.values()), timeout_s=2) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkilled_launcher_leaves_no_servers(tmp_path: Path) -> None:
    launched = _launch(tmp_path)
    launched.proc.kill()
    launched.proc.wait(timeout=5)
    assert _wait_gone(list(launched.pids.values()), timeout_s=5) == []


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    bad = "/nonexistent/bin/nats-server"
    with pytest.raises(InfraError) as info:
        Infra(InfraSettings(nats_server_path=bad)).start()
    assert bad in str(info.value)
    assert str(info.value.binary) == bad

    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.infra", "--redis-server-bin", "/nonexistent/redis"],
        capture_output=True,
        text=True,
        env=_launcher_env(tmp_path),
        timeout=30,
    )
    assert proc.returncode == 1
    assert "/nonexistent/redis" in proc.stderr


def test_failed_start_stops_what_already_started() -> None:
    # NATS starts first; Redis then fails, and NATS must not be left behind.
    infra = Infra(InfraSettings(redis_server_path="/nonexistent/redis"))
    with pytest.raises(InfraError, match="/nonexistent/redis"):
        infra.start()
    assert infra.nats is not None and infra.nats.pid is not None
    assert _wait_gone([infra.nats.pid], timeout_s=2) == []


def test_server_exiting_at_start_reports_its_output() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = NatsServer(port=port, startup_timeout_s=10)
        with pytest.raises(InfraError) as info:
            server.start()
    message = str(info.value)
    assert "exited at start" in message
    assert "address already in use" in message  # nats-server's own words, from its output
    assert str(server.binary) in message
    assert not server.alive


def test_configured_urls_start_nothing() -> None:
    settings = InfraSettings(nats_url="nats://10.0.0.1:4222", redis_url="redis://10.0.0.2:6379/0")
    with Infra(settings) as infra:
        assert infra.nats_url == "nats://10.0.0.1:4222"
        assert infra.redis_url == "redis://10.0.0.2:6379/0"
        assert infra.nats_pid is None and infra.redis_pid is None
        assert infra.local_servers() == []


def test_given_port_is_used_and_restart_keeps_it() -> None:
    port = free_port()
    with NatsServer(port=port) as server:
        assert server.url == f"nats://127.0.0.1:{port}"
        first_pid = server.pid
        server.kill()
        assert not server.alive
        server.start()
        assert server.port == port and server.pid != first_pid and server.alive


def test_settings_from_env() -> None:
    env = {
        ENV_NATS_URL: " nats://h:1 ",
        "RADIXSERVE_REDIS_PORT": "6380",
        "RADIXSERVE_NATS_PORT": "",
    }
    settings = InfraSettings.from_env(env)
    assert settings == InfraSettings(nats_url="nats://h:1", redis_port=6380)
    with pytest.raises(ValueError, match="RADIXSERVE_NATS_PORT"):
        InfraSettings.from_env({"RADIXSERVE_NATS_PORT": "abc"})
    with pytest.raises(ValueError, match="redis_port"):
        InfraSettings(redis_port=70000)
