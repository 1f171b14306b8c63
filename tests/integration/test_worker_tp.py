"""The worker service with a tensor-parallel engine (two ranks on the CPU, gloo): its
outputs equal the in-process engine's of one rank, and SIGTERM stops it and its rank."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from radixserve import Engine, protocol
from radixserve.bus import BusMsg
from tests.helpers.tiny_models import make_tiny_llama
from tests.integration.test_worker_service import _bus, _routed, _wait_ready, worker_argv
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(240)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_a_two_rank_worker_answers_as_one_rank_does(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir: Path = make_tiny_llama(tmp_path_factory.mktemp("tp_worker_model"), seed=0)
    prefix, worker_id = f"t{uuid.uuid4().hex[:8]}", "w-tp"
    subjects = protocol.Subjects(prefix)
    proc = subprocess.Popen(worker_argv(nats_url, prefix, worker_id, model_dir, "--tp-size", "2"))
    ranks: list[int] = []
    try:
        engine = Engine(model_path=str(model_dir), device="cpu")
        prompts = make_prompts(engine.runner.vocab_size, [6, 25, 11], seed=4)
        reference = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0}
        )
        engine.shutdown()
        assert isinstance(reference, list)
        tokens: dict[str, list[int]] = defaultdict(list)
        finished: set[str] = set()
        done = asyncio.Event()
        async with _bus(nats_url) as bus:

            async def on_detok(msg: BusMsg) -> None:
                for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                    tokens[out.rid] += out.new_token_ids_list
                    if out.finish_reason is not None:
                        finished.add(out.rid)
                if len(finished) == len(prompts):
                    done.set()

            await bus.subscribe(subjects.detok, on_detok)
            await _wait_ready(bus, subjects, worker_id)
            ranks = [
                pid
                for pid in _children(proc.pid)
                if b"spawn" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
            ]
            assert len(ranks) == 1, "the worker should run one more rank"
            for i, ids in enumerate(prompts):
                await bus.publish(
                    subjects.worker_run(worker_id),
                    _routed(f"r{i}", ids, worker_id, max_new_tokens=10, temperature=0.0),
                )
            await asyncio.wait_for(done.wait(), 90)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == [
            r["output_ids"] for r in reference
        ]
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, "the worker did not drain cleanly on SIGTERM"
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks), "the rank outlived its worker"


async def test_a_lost_rank_ends_an_idle_worker_at_once(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A rank killed while the worker has nothing to do: the worker does not wait for a
    request to find out (which would then fail), it exits non-zero within seconds, so it
    is restarted with all its ranks before traffic comes."""
    model_dir: Path = make_tiny_llama(tmp_path_factory.mktemp("tp_worker_lost"), seed=0)
    prefix, worker_id = f"t{uuid.uuid4().hex[:8]}", "w-tp-lost"
    subjects = protocol.Subjects(prefix)
    proc = subprocess.Popen(
        worker_argv(nats_url, prefix, worker_id, model_dir, "--tp-size", "2"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        async with _bus(nats_url) as bus:
            await _wait_ready(bus, subjects, worker_id)
        (rank,) = [
            pid
            for pid in _children(proc.pid)
            if b"spawn" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
        ]
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode != 0
    assert "tensor-parallel rank 1 exited" in stderr, stderr[-3000:]
    assert took < 15, f"the worker took {took:.1f} s to stop"
