"""Readiness through the whole stack: until a worker is ready the gateway says so (503 on
/health/ready, /health and /v1/models), and a client that waits on /v1/models, as
benchmark tools do, then sends everything at once, sees no failure.

The stack starts with no worker, so the not-ready window is certain, not a race with
the model's load; the worker is then started as `radixserve up` starts one.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.infra import free_port
from radixserve.infra.process import ManagedProcess
from radixserve.stack import Stack, StackSpec
from tests.integration.stack_fixture import TINY_CONTEXT, TINY_WORKER_ARGS

pytestmark = pytest.mark.timeout(400)

REQUESTS = 100
WAIT_S = 150.0


def _spec(nats_url: str, redis_url: str, model_dir: Path, log_dir: Path) -> StackSpec:
    context = ["--context-length", str(TINY_CONTEXT)]
    return StackSpec(
        nats_url=nats_url,
        redis_url=redis_url,
        subject_prefix=f"ready{free_port()}",
        host="127.0.0.1",
        port=free_port(),
        workers=0,  # started by the test, once the not-ready answers are seen
        model_dir=model_dir,
        served_model_name="test-model",
        worker_args=[*TINY_WORKER_ARGS, *context],
        tokenizer_args=context,
        log_dir=log_dir,
    )


def _worker(spec: StackSpec) -> ManagedProcess:
    argv = [
        sys.executable, "-m", "radixserve.cli", "serve", "worker", *spec.common_args(),
        "--instance-id", "worker-0", *spec.service_args("worker"),
    ]  # fmt: skip
    return ManagedProcess("worker-0", argv, spec.log_dir / "worker-0.log")


async def _until(http: httpx.AsyncClient, path: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            answer = await http.get(path, timeout=5.0)
            if answer.status_code == status:
                return answer
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{path} never answered {status}"
        await asyncio.sleep(0.05)


async def test_not_ready_until_a_worker_is_then_a_burst_has_no_failure(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = _spec(nats_url, redis_url, tiny_model_dir, tmp_path)
    stack = Stack(spec, say=print)
    worker = _worker(spec)
    stack.start()
    try:
        async with httpx.AsyncClient(base_url=spec.url) as http:
            await _until(http, "/health/live", 200)
            # Every other service heartbeats; only the worker is missing, and says so.
            body = (await _until(http, "/health/ready", 503)).json()
            deadline = time.monotonic() + WAIT_S
            while body["missing"] != ["worker"]:
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.1)
                body = (await http.get("/health/ready")).json()
            models = await http.get("/v1/models")
            assert models.status_code == 503, models.text
            assert models.json()["error"]["code"] == "not_ready"
            assert "worker" in models.json()["error"]["message"]
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["workers_ready"] == 0

            worker.start()
            await _until(http, "/v1/models", 200)
            client = openai.AsyncOpenAI(
                base_url=f"{spec.url}/v1", api_key="unused", max_retries=0, timeout=240.0
            )
            # No retries: every request must succeed on its first try.
            results = await asyncio.gather(
                *(
                    client.completions.create(
                        model="test-model", prompt=f"request {k}:", max_tokens=8, temperature=0
                    )
                    for k in range(REQUESTS)
                ),
                return_exceptions=True,
            )
            await client.close()
            failures = [r for r in results if isinstance(r, BaseException)]
            assert failures == [], failures[:3]
            for result in results:
                assert isinstance(result, openai.types.Completion)
                assert result.usage is not None and result.usage.completion_tokens > 0
            assert (await http.get("/health/ready")).json() == {"status": "ready"}
    finally:
        worker.stop(timeout_s=15)
        stack.stop()
