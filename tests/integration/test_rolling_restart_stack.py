"""A rolling restart of both workers under load loses no request (issue 56's acceptance:
real NATS, Redis and service processes, two workers on the tiny random model, the CPU).

Clients stream greedy completions (and a few seeded sampled ones) in a loop the whole
time. Worker-0 gets SIGTERM while it holds requests, exits, is started again and comes
back ready; then the same for worker-1. A draining worker finishes what it can within
60% of `--drain-timeout-s` and hands the rest back, and the scheduler re-routes those with
the tokens they had (`requests_migrated_total{reason="worker_drained"}`). Every request
sent must finish with the text its fault-free run gives (same request, undisturbed
stack), usage counting each token once: with drain and migration nothing may fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.bus import BusSettings
from radixserve.infra import free_port
from radixserve.services.health import HealthReport, probe
from tests.integration.stack_fixture import BATCH_EXACT_DTYPE, RunningStack, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLIENTS = 6
MAX_TOKENS = 160
# Short, so that what a worker holds at SIGTERM outlasts its 60% and is handed over.
DRAIN_TIMEOUT_S = 1.0
REQUEST_DEADLINE_S = 120.0  # a request unanswered this long is lost
WORKER_ARGS = [
    *("--device", "cpu", "--dtype", BATCH_EXACT_DTYPE, "--max-total-tokens", "32768"),
    *("--drain-timeout-s", str(DRAIN_TIMEOUT_S)),
]
SCHEDULER_METRICS_PORT = free_port()
# Greedy, and seeded among the top 5 (the random model's distributions are nearly flat:
# among all its tokens a draw would turn on the last bits of a sum, see
# test_migration_stack), each with its own prompt.
BODIES: list[dict[str, Any]] = [
    *({"prompt": f"Rolling {i}: the numbers go", "temperature": 0} for i in range(6)),
    *(
        {"prompt": f"Seeded {i}: once upon", "temperature": 1.0, "seed": 200 + i, "top_k": 5}
        for i in range(2)
    ),
]


@pytest.fixture(scope="module")
def two_workers(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    with running_stack(
        nats_url,
        redis_url,
        tiny_model_dir,
        tmp_path_factory.mktemp("rolling_logs"),
        WORKER_ARGS,
        extra_args={"scheduler": ["--metrics-port", str(SCHEDULER_METRICS_PORT)]},
        context_length=1024,
        workers=2,
    ) as running:
        yield running


@dataclass
class Outcome:
    body: int
    kind: str  # finished, failed, lost
    text: str = ""
    usage: int = 0
    code: str = ""


async def one_request(http: httpx.AsyncClient, index: int) -> Outcome:
    """One streamed completion of BODIES[index], read to its end or its error."""
    body = {
        "model": "test-model",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **BODIES[index],
    }
    parts: list[str] = []
    usage = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                error = json.loads(await reply.aread())["error"]
                return Outcome(index, "failed", code=error["code"])
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    return Outcome(index, "finished", "".join(parts), usage)
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(index, "failed", "".join(parts), code=chunk["error"]["code"])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                parts += [c["text"] for c in chunk["choices"] if c.get("text")]
    except httpx.HTTPError as exc:
        return Outcome(index, "lost", "".join(parts), code=type(exc).__name__)
    return Outcome(index, "lost", "".join(parts), code="stream ended without [DONE]")


@dataclass
class Load:
    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        timeout = httpx.Timeout(REQUEST_DEADLINE_S)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, c) for c in range(CLIENTS)))

    async def _client(self, http: httpx.AsyncClient, client: int) -> None:
        index = client
        while not self.stop.is_set():
            self.outcomes.append(await one_request(http, index % len(BODIES)))
            index += CLIENTS


async def heartbeats(running: RunningStack) -> HealthReport:
    bus = BusSettings(url=running.stack.spec.admin_nats_url)
    return await probe(bus, running.subject_prefix, 1.2)


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"


def migrated(reason: str) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{SCHEDULER_METRICS_PORT}/metrics", timeout=10).text
    prefix = f'radixserve:requests_migrated_total{{reason="{reason}"}}'
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(prefix))


async def rolling_restart(running: RunningStack, name: str) -> None:
    """SIGTERM `name` once it holds requests, wait for its exit, start it, wait for it
    ready (its own heartbeat says so)."""
    (item,) = [s for s in running.stack.services if s.name == name]

    async def holds_requests() -> bool:
        beat = (await heartbeats(running)).workers.get(name)
        return beat is not None and bool(beat.requests)

    async def exited() -> bool:
        await asyncio.sleep(0.1)
        return not item.process.alive

    async def ready() -> bool:
        return name in (await heartbeats(running)).ready_workers

    await until(f"{name} holding requests", holds_requests, 60)
    pid = item.process.pid
    assert pid is not None
    os.killpg(pid, signal.SIGTERM)  # as the kubelet does; its own process group
    await until(f"{name} exiting after SIGTERM", exited, 8 * DRAIN_TIMEOUT_S + 10)
    tail = item.process.output_tail(30)
    assert "worker stopped" in tail and "after a crash" not in tail, tail
    item.start()
    await until(f"{name} ready again", ready, 150)


def test_a_rolling_restart_of_both_workers_under_load_loses_no_request(
    two_workers: RunningStack,
) -> None:
    async def reference() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=two_workers.url, timeout=120) as http:
            return list(await asyncio.gather(*(one_request(http, i) for i in range(len(BODIES)))))

    expected = asyncio.run(reference())
    assert all(o.kind == "finished" and o.usage == MAX_TOKENS for o in expected), expected

    async def with_restarts() -> Load:
        load = Load(two_workers.url)
        task = asyncio.create_task(load.run())
        for name in ("worker-0", "worker-1"):
            await rolling_restart(two_workers, name)
        load.stop.set()  # each client finishes the request it has in flight
        await asyncio.wait_for(task, REQUEST_DEADLINE_S + 10)
        return load

    load = asyncio.run(with_restarts())
    print(f"{len(load.outcomes)} requests, migrated (drained) {migrated('worker_drained')}")
    not_finished = [o for o in load.outcomes if o.kind != "finished"]
    assert not_finished == [], "with drain and migration no request may fail"
    for outcome in load.outcomes:
        reference_run = expected[outcome.body]
        assert outcome.text == reference_run.text, f"body {outcome.body} differs from its run"
        assert outcome.usage == MAX_TOKENS, f"body {outcome.body}: usage {outcome.usage}"
    assert len(load.outcomes) >= 2 * CLIENTS
    assert migrated("worker_drained") >= 1, "no drain handed a request over"
