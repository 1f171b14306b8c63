"""The `radixserve` command as a user runs it, with the embedded model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.commands import CLI, cli_env, sigint_as_in_a_terminal

pytestmark = pytest.mark.timeout(300)


def test_generate_answers_with_the_embedded_model() -> None:
    proc = subprocess.run(
        [*CLI, "generate", "What is the capital of France?", "--chat", "--max-new-tokens", "20"],
        capture_output=True,
        text=True,
        timeout=240,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


def test_up_serves_the_api_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    """`radixserve up` as a user runs it: healthy within 90 s, curl works, Ctrl-C cleans up."""
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    port = _free_port()
    proc = subprocess.Popen(
        [
            *CLI,
            "up",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--subject-prefix",
            prefix,
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        preexec_fn=sigint_as_in_a_terminal,
    )
    lines: list[str] = []
    try:
        started = time.monotonic()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "radixserve is up" in line:
                break
        elapsed = time.monotonic() - started
        assert any("radixserve is up" in line for line in lines), "".join(lines)
        # On loopback no key is needed, and the banner says so.
        assert "no API key needed: it listens on 127.0.0.1 only" in next(proc.stdout)
        assert elapsed < 90, f"healthy after {elapsed:.0f}s"
        infra = [line for line in lines if line.startswith(("NATS ", "Redis "))]
        ports = [line.rsplit(":", 1)[1].split("/")[0].strip() for line in infra]
        curl = subprocess.run(
            [
                "curl",
                "-s",
                "--max-time",
                "60",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps(
                    {
                        "messages": [{"role": "user", "content": "What is the capital of France?"}],
                        "max_tokens": 20,
                        "temperature": 0,
                    }
                ),
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        reply = json.loads(curl.stdout)
        assert "Paris" in reply["choices"][0]["message"]["content"], reply
        assert _processes_mentioning(prefix), "the services should be running"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    deadline = time.monotonic() + 10
    while _processes_mentioning(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(prefix) == [], "services outlived `up`"
    for p in ports:
        assert _processes_mentioning(f"--port {p}") == [] and _processes_mentioning(f":{p}") == []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_model_path_is_a_clear_error() -> None:
    proc = subprocess.run(
        [*CLI, "generate", "hi", "--model", "/nonexistent/model"],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 2
    assert "radixserve:" in proc.stderr and "/nonexistent/model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_up_refuses_another_interface_without_api_keys(tmp_path: Path) -> None:
    """Nothing starts: the refusal comes before NATS, Redis or any service."""
    proc = subprocess.run(
        [*CLI, "up", "--device", "cpu", "--api-host", "0.0.0.0", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refusing to serve 0.0.0.0 without API keys" in proc.stderr
    assert "--allow-unauthenticated" in proc.stderr and "Traceback" not in proc.stderr
    assert "NATS" not in proc.stdout  # no server was started
