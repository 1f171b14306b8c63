"""Cache-aware routing across two workers, end to end: once one worker has cached a
long system prompt (its KV events reached the scheduler's mirror), every request that
shares it goes to that worker and finds it cached, where least-load routing would have
sent half of them to the other worker to compute it again. The answers equal the
in-process engine's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import Engine
from radixserve.infra import free_port
from tests.helpers.tiny_models import make_tiny_llama
from tests.integration.stack_fixture import RunningStack, running_stack

pytestmark = pytest.mark.timeout(300)

WORKER_ARGS = ["--device", "cpu", "--max-total-tokens", "8192"]
SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the radix tree." for i in range(12))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("routing_model"), seed=0)


@pytest.fixture(scope="module")
def stack(
    nats_url: str, redis_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    with running_stack(
        nats_url,
        redis_url,
        model_dir,
        tmp_path_factory.mktemp("routing_logs"),
        WORKER_ARGS,
        extra_args={"scheduler": ["--routing", "cache_aware"]},
        workers=2,
    ) as running:
        deadline = time.monotonic() + 120
        while httpx.get(f"{running.url}/health", timeout=5).json().get("workers_ready") != 2:
            assert time.monotonic() < deadline, "the second worker never became ready"
            time.sleep(0.5)
        yield running


def test_requests_sharing_a_cached_prefix_go_to_its_worker(
    stack: RunningStack, model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    engine = Engine(model_path=str(model_dir), device="cpu")
    try:
        prompt_tokens = len(engine.tokenizer.encode(SYSTEM))
        questions = [f"{SYSTEM} Question {i}: what is cached?" for i in range(8)]
        reference = [
            engine.generate(q, {"max_new_tokens": 6, "temperature": 0})["text"]  # type: ignore[index]
            for q in questions
        ]
    finally:
        engine.shutdown()
    assert prompt_tokens >= 64  # several 16-token blocks of shared prefix

    def ask(i: int) -> tuple[str, int]:
        reply = client.completions.create(
            model=stack.model, prompt=questions[i], max_tokens=6, temperature=0
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return reply.choices[0].text, usage.prompt_tokens_details.cached_tokens or 0

    first_text, first_cached = ask(0)  # caches the system prompt on one worker
    assert first_text == reference[0] and first_cached == 0
    time.sleep(1.0)  # its KV events reach the scheduler's mirror (milliseconds, in practice)
    with ThreadPoolExecutor(max_workers=7) as pool:
        answers = list(pool.map(ask, range(1, 8)))
    # Least-load routing would have spread these over both workers, and the requests on
    # the other one would have found nothing cached.
    for (text, cached), expected in zip(answers, reference[1:], strict=True):
        assert text == expected
        assert cached >= prompt_tokens - 16, (cached, prompt_tokens)


SNAPSHOTS = "radixserve:scheduler_kv_snapshot_requests_total"


def _totals(metrics_port: int) -> dict[str, float]:
    """Every sample of the scheduler's /metrics, summed over labels, by name."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_a_new_scheduler_learns_the_caches_from_snapshots(stack: RunningStack) -> None:
    """A scheduler started after the workers cached prompts (a restart, a failover) sees
    their heartbeats announce KV event batches it never got, asks each worker for a
    snapshot, and routes by the caches from then on: here the old scheduler is stopped,
    so every request goes through the new one."""
    spec = stack.stack.spec
    metrics_port = free_port()
    replacement = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "scheduler",
            *spec.common_args(),
            "--instance-id",
            "scheduler-new",
            "--routing",
            "cache_aware",
            "--metrics-port",
            str(metrics_port),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{stack.url}/health", timeout=5).json()["services"].get("scheduler") != 2:
            assert time.monotonic() < deadline, "the second scheduler never came up"
            time.sleep(0.3)
        (old,) = [s for s in stack.stack.services if s.name.startswith("scheduler")]
        old.process.stop(timeout_s=15)
        deadline = time.monotonic() + 30
        while _totals(metrics_port).get(SNAPSHOTS, 0.0) < 1:
            assert time.monotonic() < deadline, "the new scheduler asked for no snapshot"
            time.sleep(0.2)
        time.sleep(1.0)  # the snapshot's answer: one engine loop and a NATS hop away
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        for i in range(4):
            reply = client.completions.create(
                model=stack.model,
                prompt=f"{SYSTEM} Question {10 + i}: where does it go?",
                max_tokens=2,
                temperature=0,
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached = reply.usage.prompt_tokens_details.cached_tokens or 0
            assert cached >= 64, f"request {i} found {cached} tokens cached"
        # The new scheduler expected those hits (least-load routing expects none), from
        # mirrors it could only have built from snapshots.
        totals = _totals(metrics_port)
        assert totals[SNAPSHOTS] >= 1
        assert totals["radixserve:scheduler_expected_cached_tokens_total"] >= 4 * 64
    finally:
        replacement.terminate()
        replacement.wait(timeout=30)
