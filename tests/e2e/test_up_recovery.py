"""`radixserve up` survives its own NATS and Redis being SIGKILLed: it restarts them on
their ports, the services reconnect, and the API answers again within 15 s. Ctrl-C then
still stops every process `up` started. Also `radixserve health --wait`."""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from radixserve.infra import free_port
from tests.e2e.commands import CLI, cli_env, sigint_as_in_a_terminal
from tests.helpers.tiny_models import make_tiny_llama

BACK_WITHIN_S = 15.0  # the acceptance bound, kill to the first good answer
POLL_REQUEST_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 240.0  # a loaded 2-core machine starts six Python services slowly


@dataclass
class Output:
    """Lines a child writes, collected by a thread so its pipe never fills."""

    lines: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._lock:
                self.lines.append(line)

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def wait_for(self, needle: str, timeout_s: float, proc: subprocess.Popen[str]) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if needle in self.text():
                return True
            time.sleep(0.2)
        return needle in self.text()


@dataclass
class Up:
    proc: subprocess.Popen[str]
    output: Output
    url: str
    prefix: str

    def infra_url(self, label: str) -> str:
        """The URL `up` printed on its `NATS  ...` / `Redis ...` line."""
        for line in self.output.text().splitlines():
            if line.startswith(label):
                return line.split()[1]
        raise AssertionError(f"no {label!r} line in:\n{self.output.text()}")

    def descendants(self) -> dict[int, str]:
        """pid -> command line of every process under `up`."""
        return descendants(self.proc.pid)

    def child_pid(self, binary: str) -> int:
        found = [pid for pid, cmd in self.descendants().items() if binary in cmd.split()[0]]
        assert len(found) == 1, f"{binary}: {found} in {self.descendants()}"
        return found[0]


def descendants(root: int) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The command name may hold spaces or parentheses: fields follow the last ')'.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        todo += children.get(pid, [])
        if cmdline:  # empty: a zombie, dead already
            found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextmanager
def radixserve_up(tmp_path: Path) -> Iterator[Up]:
    model = make_tiny_llama(tmp_path / "model", seed=0)
    port, prefix = free_port(), f"rec{uuid.uuid4().hex[:8]}"
    argv = [
        *CLI,
        "up",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--context-length",
        "1024",
        "--max-total-tokens",
        "16384",
        "--port",
        str(port),
        "--subject-prefix",
        prefix,
        "--log-dir",
        str(tmp_path / "logs"),
        "--ready-timeout-s",
        str(READY_TIMEOUT_S),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        preexec_fn=sigint_as_in_a_terminal,
    )
    output = Output()
    reader = threading.Thread(target=output.follow, args=(proc,), daemon=True)
    reader.start()
    try:
        ready = output.wait_for("radixserve is up", READY_TIMEOUT_S + 30, proc)
        assert ready, output.text()
        yield Up(proc, output, f"http://127.0.0.1:{port}", prefix)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        reader.join(timeout=10)


def chat_once(client: httpx.Client, url: str) -> str | None:
    """The request id of a successful chat completion; None on any failure."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    try:
        reply = client.post(f"{url}/v1/chat/completions", json=body)
        if reply.status_code != 200 or not reply.json()["choices"]:
            return None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return reply.headers.get("X-Request-Id", "")


def record_finished(client: httpx.Client, url: str, rid: str) -> bool:
    """The gateway wrote the request's record to Redis and can read it back."""
    try:
        reply = client.get(f"{url}/v1/requests/{rid}")
        return reply.status_code == 200 and reply.json().get("state") == "finished"
    except (httpx.HTTPError, ValueError):
        return False


def seconds_until(check: Callable[[], bool], started: float, give_up_s: float) -> float:
    """Seconds from `started` until `check()` first holds; inf if not within `give_up_s`."""
    while time.monotonic() - started < give_up_s:
        if check():
            return time.monotonic() - started
        time.sleep(0.2)
    return float("inf")


def kill_and_time_recovery(
    up: Up, binary: str, serving: Callable[[], bool]
) -> tuple[float, int, int]:
    """SIGKILL `up`'s `binary` child; (seconds until `serving()`, old pid, new pid)."""
    old = up.child_pid(binary)
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    seconds = seconds_until(serving, killed_at, give_up_s=90.0)
    assert seconds <= BACK_WITHIN_S, (
        f"not serving {seconds:.1f}s after killing {binary}\n{up.output.text()}"
    )
    return seconds, old, up.child_pid(binary)


def health_wait(up: Up) -> None:
    """`radixserve health --wait` with the credentials `up` wrote (its `Creds` file, the
    admin's NATS user) exits 0; without them `up`'s NATS refuses it."""
    creds = Path(up.infra_url("Creds"))
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    admin = dict(shlex.split(line)[0].split("=", 1) for line in creds.read_text().splitlines())
    health = subprocess.run(
        [*CLI, "health", "--wait", "60", "--subject-prefix", up.prefix],
        capture_output=True,
        text=True,
        timeout=120,
        env={**cli_env(), **admin},
    )
    assert health.returncode == 0, health.stdout + health.stderr
    anonymous = subprocess.run(
        [*CLI, "health", "--nats-url", up.infra_url("NATS"), "--subject-prefix", up.prefix],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert anonymous.returncode == 1 and "wants credentials" in anonymous.stderr, anonymous.stderr


@pytest.mark.timeout(600)
def test_up_recovers_from_killed_nats_and_redis_and_ctrl_c_leaves_nothing(
    tmp_path: Path,
) -> None:
    with (
        radixserve_up(tmp_path) as up,
        httpx.Client(timeout=POLL_REQUEST_TIMEOUT_S) as client,
    ):
        health_wait(up)
        assert chat_once(client, up.url) is not None, up.output.text()

        nats_s, old_nats, new_nats = kill_and_time_recovery(
            up, "nats-server", lambda: chat_once(client, up.url) is not None
        )

        rids: list[str] = []

        def chat_recorded() -> bool:
            # Served, and the record of a recent request written to the new Redis and
            # read back (the records of requests made while it was down are lost).
            rid = chat_once(client, up.url)
            rids.extend([rid] if rid else [])
            return any(record_finished(client, up.url, r) for r in rids[-5:])

        redis_s, old_redis, new_redis = kill_and_time_recovery(up, "redis-server", chat_recorded)
        print(f"serving again {nats_s:.1f}s after killing NATS, {redis_s:.1f}s after Redis")
        assert new_nats != old_nats and new_redis != old_redis
        text = up.output.text()
        assert "nats-server restarted" in text and "redis-server restarted" in text, text
        tree = up.descendants()
        for label, pid in (("NATS", new_nats), ("Redis", new_redis)):
            port = up.infra_url(label).rsplit(":", 1)[1].split("/")[0]
            # On the port the services know (redis-server retitles itself "... host:port").
            assert re.search(rf"[ :]{port}( |$)", tree[pid]), tree[pid]

        # Every service heartbeats again, and the grammar service (NATS, and Redis for its
        # cache) compiles: a JSON-constrained request is answered.
        health_wait(up)
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "response_format": {"type": "json_object"},
        }
        constrained = client.post(f"{up.url}/v1/chat/completions", json=body, timeout=120)
        assert constrained.status_code == 200, constrained.text

        assert len(tree) >= 8, tree  # six services, NATS and Redis
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=90) == 0, up.output.text()
        left = gone(list(tree), timeout_s=20)
        assert left == [], {pid: tree[pid] for pid in left}


def test_health_wait_gives_up_with_what_is_missing() -> None:
    nothing = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [*CLI, "health", "--wait", "1", "--nats-url", nothing],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"missing after 1s: NATS at {nothing}" in proc.stderr
