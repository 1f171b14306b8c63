"""The detokenizer SIGKILLed and restarted while greedy streams are mid-way (real NATS,
Redis and service processes, the tiny random model on the CPU): every stream goes on.

The restarted detokenizer asks the worker for each request it meets mid-way (and, on
start, for every request, so those that finished while it was away come back too),
decodes the history from the start, and the gateway skips by the deltas' offsets what
the client already has. The reference: each request streamed alone before the fault.
Each faulty stream's text and usage equal it (each token once, none missing, whether it
finished while the detokenizer was away or after); a resumable stream whose client drops
after the restart and resumes with Last-Event-ID gets exactly the rest of the text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.stack_fixture import RunningStack, own_stack, supervise
from tests.integration.stack_load import Events, body, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CLIENTS = 6
MAX_TOKENS = 160
PROMPTS = [f"Restart {i}: the numbers go" for i in range(CLIENTS)]


# A stack of its own: its detokenizer is killed.
stack = own_stack("detok_restart_logs")


async def stream(
    http: httpx.AsyncClient,
    prompt: str,
    events: Events,
    cut: Callable[[Events], bool] | None = None,
) -> Events:
    request = body(prompt, MAX_TOKENS)
    async with http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200, await response.aread()
        events.rid = response.headers["x-request-id"]
        return await read_events(response.aiter_lines(), events, cut)


async def resume(http: httpx.AsyncClient, rid: str, last_id: str) -> Events:
    path = f"/v1/requests/{rid}/output"
    async with http.stream("GET", path, headers={"Last-Event-ID": last_id}) as response:
        assert response.status_code == 200, await response.aread()
        return await read_events(response.aiter_lines(), Events(rid=rid))


def test_streams_go_on_across_a_detokenizer_restart(stack: RunningStack) -> None:
    (detokenizer,) = [s for s in stack.stack.services if s.name.startswith("detokenizer")]

    async def reference() -> list[Events]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            return [await stream(http, prompt, Events()) for prompt in PROMPTS]

    expected = asyncio.run(reference())
    assert all(e.done and e.usage for e in expected)
    stop_supervising = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(stack, stop_supervising), daemon=True)

    async def with_restart() -> tuple[list[Events], Events, Events, int]:
        restarted = asyncio.Event()
        progress = [Events() for _ in PROMPTS]
        cut = Events()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            streams = [
                asyncio.create_task(stream(http, prompt, events))
                for prompt, events in zip(PROMPTS, progress, strict=True)
            ]
            # The resumable one hangs up at its first event after the restart.
            cutting = asyncio.create_task(
                stream(http, PROMPTS[0], cut, lambda _: restarted.is_set())
            )
            deadline = time.monotonic() + 60
            while not all(len(e.texts) >= 2 or e.done for e in [*progress, cut]):
                assert time.monotonic() < deadline, "the streams did not start"
                await asyncio.sleep(0.02)
            restarts = detokenizer.restarts
            detokenizer.process.kill()  # mid-way
            supervisor.start()
            while detokenizer.restarts == restarts:
                assert time.monotonic() < deadline, "the detokenizer was not restarted"
                await asyncio.sleep(0.1)
            unfinished = sum(not e.done for e in progress)
            restarted.set()
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
            first = await asyncio.wait_for(cutting, 120)
            assert first.last_id is not None
            rest = await asyncio.wait_for(resume(http, first.rid, first.last_id), 60)
        return results, first, rest, unfinished

    try:
        results, first, rest, unfinished = asyncio.run(with_restart())
    finally:
        stop_supervising.set()
        if supervisor.is_alive():
            supervisor.join(timeout=30)
    print(f"streams unfinished when the detokenizer was restarted: {unfinished} of {CLIENTS}")
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    for got, want in zip(results, expected, strict=True):
        assert got.done and got.text == want.text
        assert got.usage is not None and want.usage is not None
        assert [got.usage[k] for k in counts] == [want.usage[k] for k in counts]
    # The resumed stream: what it had before it hung up, then exactly the rest.
    assert first.text + rest.text == expected[0].text
    assert rest.done and rest.usage is not None and expected[0].usage is not None
    assert rest.usage["completion_tokens"] == expected[0].usage["completion_tokens"]
