"""The whole stack for integration tests: real NATS and Redis, the six services as
processes (`radixserve.stack.Stack`, the code `radixserve up` runs), one model."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.infra import free_port
from radixserve.stack import Stack, StackSpec
from tests.helpers.tiny_models import make_tiny_llama

# float32 for the tests that compare answers across batchings (concurrent against one at
# a time, the stack against the in-process engine): bfloat16 ("auto" on a CPU that
# multiplies it natively) rounds sums differently by batch.
BATCH_EXACT_DTYPE = "float32"
CPU_WORKER_ARGS = ["--device", "cpu", "--dtype", BATCH_EXACT_DTYPE, "--max-total-tokens", "16384"]


@dataclass(frozen=True)
class RunningStack:
    stack: Stack
    url: str
    model: str
    subject_prefix: str
    nats_url: str


@contextmanager
def running_stack(
    nats_url: str,
    redis_url: str,
    model_dir: Path,
    log_dir: Path,
    worker_args: list[str],
    extra_args: dict[str, list[str]] | None = None,
    context_length: int | None = None,
    ready_timeout_s: float = 150.0,
    workers: int = 1,
) -> Iterator[RunningStack]:
    prefix = f"s{uuid.uuid4().hex[:8]}"
    context = ["--context-length", str(context_length)] if context_length else []
    spec = StackSpec(
        nats_url=nats_url,
        redis_url=redis_url,
        subject_prefix=prefix,
        host="127.0.0.1",
        port=free_port(),
        workers=workers,
        model_dir=model_dir,
        served_model_name="test-model",
        worker_args=[*worker_args, *context],
        tokenizer_args=context,
        log_dir=log_dir,
        extra_args=extra_args or {},
    )
    stack = Stack(spec, say=print)
    stack.start()
    try:
        stack.wait_healthy(ready_timeout_s)
        yield RunningStack(stack, spec.url, "test-model", prefix, nats_url)
    finally:
        stack.stop()


def own_stack(
    logs: str,
    worker_args: list[str] = CPU_WORKER_ARGS,
    extra_args: dict[str, list[str]] | None = None,
    context_length: int = 512,
    workers: int = 1,
) -> Any:
    """A module's fixture (`two_workers = own_stack("rolling_logs", workers=2)`): a stack
    of its own on the tiny model, for a module that kills or restarts its services, which
    the shared `tiny_stack`'s users must not see; its logs in a folder named `logs`."""

    @pytest.fixture(scope="module")
    def fixture(
        nats_url: str,
        redis_url: str,
        tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[RunningStack]:
        with running_stack(
            nats_url,
            redis_url,
            tiny_model_dir,
            tmp_path_factory.mktemp(logs),
            worker_args,
            extra_args=extra_args,
            context_length=context_length,
            workers=workers,
        ) as running:
            yield running

    return fixture


def supervise(running: RunningStack, stop: threading.Event) -> None:
    """Restart the stack's dead children until `stop`, as `radixserve up` does (run in a
    thread beside the test's event loop)."""
    while not stop.is_set():
        running.stack.supervise_once()
        time.sleep(0.2)


# A tiny random-weight Llama served on the CPU, for modules that compare the stack with
# the in-process engine on the same weights (each module starts its own).
TINY_WORKER_ARGS = ["--device", "cpu", "--max-total-tokens", "16384"]
TINY_CONTEXT = 1024


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_model"), seed=0)


@contextmanager
def tiny_running_stack(
    nats_url: str,
    redis_url: str,
    model_dir: Path,
    log_dir: Path,
    extra_args: dict[str, list[str]] | None = None,
) -> Iterator[RunningStack]:
    """The stack on the tiny model's CPU settings; `extra_args`: more flags by service."""
    with running_stack(
        nats_url,
        redis_url,
        model_dir,
        log_dir,
        TINY_WORKER_ARGS,
        extra_args=extra_args,
        context_length=TINY_CONTEXT,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def tiny_stack(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    log_dir = tmp_path_factory.mktemp("tiny_stack_logs")
    with tiny_running_stack(nats_url, redis_url, tiny_model_dir, log_dir) as running:
        yield running


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """The in-process engine on the tiny stack's weights."""
    engine = Engine(model_path=str(tiny_model_dir), device="cpu", context_length=TINY_CONTEXT)
    yield engine
    engine.shutdown()
