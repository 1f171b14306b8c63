"""The `radixserve` command as a user runs it, with the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixserve.infra.settings import ENV_NATS_URL, ENV_REDIS_URL

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "radixserve.cli"]


def _env() -> dict[str, str]:
    # `up` must start its own servers here, whatever the test session points at.
    return {k: v for k, v in os.environ.items() if k not in (ENV_NATS_URL, ENV_REDIS_URL)}


def test_generate_answers_with_the_embedded_model() -> None:
    proc = subprocess.run(
        [*CLI, "generate", "What is the capital of France?", "--chat", "--max-new-tokens", "20"],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_up_starts_infra_and_chats_until_eof() -> None:
    proc = subprocess.run(
        [*CLI, "up", "--device", "cpu"],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "NATS  nats://127.0.0.1:" in proc.stdout
    assert "Redis redis://127.0.0.1:" in proc.stdout
    assert "Not there yet" in proc.stdout
    assert "model> " in proc.stdout and "Paris" in proc.stdout.split("model> ", 1)[1]


def test_bad_model_path_is_a_clear_error() -> None:
    proc = subprocess.run(
        [*CLI, "generate", "hi", "--model", "/nonexistent/model"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "radixserve:" in proc.stderr and "/nonexistent/model" in proc.stderr
    assert "Traceback" not in proc.stderr
