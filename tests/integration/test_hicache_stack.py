"""HiCache's shared tier through the stack: a worker killed and started again answers a
prompt from the KV blocks it stored before (real NATS, Redis and service processes, the
tiny random model, the CPU). Its radix cache starts empty: every cached token of the
second answer came from the storage directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from radixserve.bus import BusSettings
from radixserve.services.health import probe
from tests.integration.stack_fixture import CPU_WORKER_ARGS, RunningStack, own_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STORE = tempfile.mkdtemp(prefix="radixserve-hicache-")
WORKER_ARGS = [
    *CPU_WORKER_ARGS,
    *("--hicache-size-gb", "0.01", "--hicache-write-policy", "write_through"),
    *("--hicache-storage-dir", STORE),
]
PROMPT = "The shared tier keeps this prefix for the next worker. " * 6

hicache_stack = own_stack("hicache_logs", WORKER_ARGS, context_length=1024)


@pytest.fixture(scope="module", autouse=True)
def _remove_store() -> Iterator[None]:
    yield
    shutil.rmtree(STORE, ignore_errors=True)


def complete(running: RunningStack) -> tuple[str, int, int]:
    response = httpx.post(
        f"{running.url}/v1/completions",
        json={"model": running.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    data = response.json()
    usage = data["usage"]
    return (
        data["choices"][0]["text"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


async def wait_ready(running: RunningStack, name: str, timeout_s: float) -> None:
    bus = BusSettings(url=running.stack.spec.admin_nats_url)
    deadline = time.monotonic() + timeout_s
    while name not in (await probe(bus, running.subject_prefix, 1.2)).ready_workers:
        assert time.monotonic() < deadline, f"{name} not ready within {timeout_s:.0f}s"


def test_a_restarted_worker_answers_from_the_blocks_it_stored(hicache_stack: RunningStack) -> None:
    text, prompt_tokens, cached = complete(hicache_stack)
    assert cached == 0
    assert prompt_tokens > 48
    (worker,) = [s for s in hicache_stack.stack.services if s.name == "worker-0"]
    pid = worker.process.pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while worker.process.alive:
        assert time.monotonic() < deadline, "worker-0 outlived SIGKILL"
        time.sleep(0.1)
    worker.start()
    asyncio.run(wait_ready(hicache_stack, "worker-0", 150))
    again, _, cached = complete(hicache_stack)
    assert again == text
    # The prompt's whole 16-token blocks (the last token is always computed).
    assert cached == (prompt_tokens - 1) // 16 * 16
