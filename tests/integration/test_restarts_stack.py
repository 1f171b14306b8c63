"""Every service and server killed (SIGKILL) and restarted, one at a time, under a steady
load of streams: no request is lost, and new requests succeed soon after (real NATS,
Redis and service processes of their own, the tiny random model on the CPU).

Clients stream greedy completions in a loop. One whose connection drops (its gateway
killed) reconnects with the last event id it had, as a resuming client does. Each
request ends in one of three ways: finished with the text a fault-free run gives (each
token once), failed with an error the client can read (an HTTP error or an SSE error
event, with its code), or lost: no answer by its deadline, or a stream cut short and not
resumable. The test asserts none is lost, every finished text is right, the worker ran
with its KV invariant checked after every step and never died, and a new request
succeeded within RECOVERY_S of each restart. The detokenizer's restart fails nothing:
it rebuilds each stream from the worker's history (no `output_lost`), so every request
that ends while it is down or coming back finishes with the reference text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.infra import NatsServer, RedisServer
from tests.integration.stack_fixture import (
    CPU_WORKER_ARGS,
    RunningStack,
    running_stack,
    supervise,
)
from tests.integration.stack_load import Load, body, one_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLIENTS = 6
MAX_TOKENS = 40
BODIES = [body(f"Load {i}: the numbers go", MAX_TOKENS, usage=False) for i in range(CLIENTS)]
REQUEST_DEADLINE_S = 60.0  # a request unanswered this long is lost
# From a restart to the first request that succeeds after it: a loose bound (it includes
# the service's start-up on a loaded machine); the figures measured go in the docs.
RECOVERY_S = 30.0
FAULTS = ("scheduler", "detokenizer", "tokenizer", "gateway", "nats-server", "redis-server")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # Servers of its own: killing them must not touch the other tests' shared ones. The
    # worker checks its KV accounting after every step (an engine option with no flag).
    with (
        pytest.MonkeyPatch.context() as env,
        NatsServer() as nats,
        RedisServer() as redis,
    ):
        env.setenv("RADIXSERVE_DEBUG_CHECK_INVARIANTS", "true")
        with running_stack(
            nats.url,
            redis.url,
            tiny_model_dir,
            tmp_path_factory.mktemp("restart_logs"),
            CPU_WORKER_ARGS,
            extra_args={
                "gateway": ["--request-timeout-s", "30", "--lost-check-s", "5"],
                "scheduler": ["--worker-timeout-s", "3"],
            },
            context_length=512,
        ) as running:
            running.stack.adopt([nats, redis])
            yield running


def process_of(running: RunningStack, name: str) -> Any:
    children = [*running.stack.servers, *running.stack.services]
    (item,) = [c for c in children if c.name == name or c.name == f"{name}-0"]
    return item


def test_each_service_and_server_restarted_under_load_loses_no_request(
    stack: RunningStack,
) -> None:
    async def reference() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            results = [
                await one_request(http, BODIES[i], i, REQUEST_DEADLINE_S, resume=True)
                for i in range(CLIENTS)
            ]
        assert all(r.kind == "finished" for r in results), results
        return [r.text for r in results]

    expected = asyncio.run(reference())
    worker = process_of(stack, "worker")
    stop_supervising = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(stack, stop_supervising), daemon=True)
    supervisor.start()
    recovered: dict[str, float] = {}
    windows: dict[str, tuple[float, float]] = {}  # from the kill to the next fault

    async def with_faults() -> Load:
        # Each client resumes a stream its gateway's death cut, as a resuming client does.
        load = Load(stack.url, BODIES, CLIENTS, REQUEST_DEADLINE_S, resume=True, retry_pause_s=0.5)
        task = asyncio.create_task(load.run())
        await asyncio.sleep(3)
        for name in FAULTS:
            item = process_of(stack, name)
            restarts = item.restarts
            item.process.kill()
            killed_at = time.monotonic()
            while item.restarts == restarts:
                assert time.monotonic() - killed_at < 60, f"{name} was not restarted"
                await asyncio.sleep(0.1)
            restarted_at = time.monotonic()
            while not any(
                o.kind == "finished" and o.ended_at > restarted_at for o in load.outcomes
            ):
                assert time.monotonic() - restarted_at < 60, f"nothing succeeds after {name}"
                await asyncio.sleep(0.1)
            recovered[name] = time.monotonic() - restarted_at
            await asyncio.sleep(2)
            windows[name] = (killed_at, time.monotonic())
        load.stop.set()
        await asyncio.wait_for(task, REQUEST_DEADLINE_S + 10)
        return load

    try:
        load = asyncio.run(with_faults())
    finally:
        stop_supervising.set()
        supervisor.join(timeout=30)
    kinds = Counter(o.kind for o in load.outcomes)
    codes = Counter(o.code for o in load.outcomes if o.kind == "failed")
    print(f"outcomes {dict(kinds)}, failures by code {dict(codes)}, recovery s {recovered}")
    assert kinds["lost"] == 0, [o for o in load.outcomes if o.kind == "lost"]
    assert codes["output_lost"] == 0
    # The requests sent after the fault before it had settled, that ended around this one.
    after = windows[FAULTS[FAULTS.index("detokenizer") - 1]][1]
    start, end = windows["detokenizer"]
    around_detokenizer = [
        o for o in load.outcomes if o.started_at >= after and start <= o.ended_at <= end
    ]
    assert around_detokenizer and all(o.kind == "finished" for o in around_detokenizer), [
        o for o in around_detokenizer if o.kind != "finished"
    ]
    wrong = [o for o in load.outcomes if o.kind == "finished" and o.text != expected[o.index]]
    assert wrong == []
    assert kinds["finished"] > len(FAULTS) * CLIENTS
    assert worker.restarts == 0, "the worker died (its KV invariant is checked every step)"
    slow = {name: s for name, s in recovered.items() if s > RECOVERY_S}
    assert slow == {}, f"first success after the restart took longer than {RECOVERY_S}s"
