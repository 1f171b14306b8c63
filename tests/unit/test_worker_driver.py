"""The engine thread's driver: a flush the asking side gave up on (its future cancelled
while queued, as `asyncio.wait_for` does on timeout) is skipped, not answered into a
cancelled future, which raised InvalidStateError in the engine thread and stopped it;
a step that never returns is told apart from a busy engine, and located."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from radixserve import Engine
from radixserve.engine.groups import ChoiceOutput
from radixserve.services.worker import engine_failure
from radixserve.worker.driver import EngineDriver


def test_a_cancelled_flush_is_skipped_and_the_engine_thread_goes_on(tiny_llama_dir: Path) -> None:
    engine = Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", max_total_tokens=512
    )
    driver = EngineDriver(engine, on_step=lambda step, outs: None, on_reject=lambda e, g: None)
    try:
        given_up = driver.flush_cache()  # queued before the thread runs
        assert given_up.cancel()
        driver.start()
        answered = driver.flush_cache()
        assert answered.result(timeout=30) is True
        assert driver.error is None and driver.alive
    finally:
        driver.stop()
        engine.shutdown()


def test_a_hung_step_is_told_apart_and_located(tiny_llama_dir: Path) -> None:
    """One step that does not return: the driver says how long it has run and where the
    engine thread is; past the worker's --engine-stall-s that is a failure (0 = never)."""
    engine = Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", max_total_tokens=512
    )
    release = threading.Event()
    real_step = engine.step

    def hung_step() -> list[ChoiceOutput]:
        release.wait(timeout=30)  # a stuck device, say
        return real_step()

    engine.step = hung_step  # type: ignore[method-assign]
    driver = EngineDriver(engine, on_step=lambda step, outs: None, on_reject=lambda e, g: None)
    try:
        assert driver.step_running_s() == 0.0 and engine_failure(driver, 0.1) is not None
        engine.submit([1, 2, 3], {"max_new_tokens": 2})  # before the engine thread runs
        driver.start()
        deadline = time.monotonic() + 10
        while driver.step_running_s() < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        failure = engine_failure(driver, 0.2)
        assert failure is not None and "the engine is hung" in failure
        assert "--engine-stall-s 0.2s" in failure
        assert engine_failure(driver, 0) is None  # no limit
        assert engine_failure(driver, 60) is None  # within the limit
        assert "in hung_step" in driver.thread_stack()  # where it hangs, for the log
        release.set()
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_work() and driver.step_running_s() == 0.0
        assert engine_failure(driver, 0.2) is None  # alive, between steps
    finally:
        release.set()
        driver.stop()
        engine.shutdown()
    assert engine_failure(driver, 0.2) == "the engine thread stopped"
    driver.error = RuntimeError("CUDA error")
    assert engine_failure(driver, 0.2) == "the engine thread failed: RuntimeError('CUDA error')"


def test_kv_events_follow_the_steps_and_a_snapshot_rebuilds_them(tiny_llama_dir: Path) -> None:
    """The engine thread hands the cache's changes over after the steps that made them; a
    snapshot, asked for between steps, describes the same blocks from a clear."""
    from radixserve.protocol import AllBlocksCleared, KvEvent, block_hashes
    from tests.unit.test_kv_block_events import replay

    engine = Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", max_total_tokens=512
    )
    block = engine.enable_kv_events()
    batches: list[list[KvEvent]] = []
    lock = threading.Lock()

    def on_kv_events(events: list[KvEvent]) -> None:
        with lock:
            batches.append(events)

    def take() -> list[list[KvEvent]]:
        with lock:
            taken = list(batches)
            batches.clear()
        return taken

    driver = EngineDriver(
        engine,
        on_step=lambda step, outs: None,
        on_reject=lambda e, g: None,
        on_kv_events=on_kv_events,
    )
    prompt = [(5 * i) % 90 + 3 for i in range(3 * block + 5)]
    expected = set(block_hashes(prompt, block))
    try:
        engine.submit(prompt, {"max_new_tokens": 3, "temperature": 0})  # before the thread
        driver.start()
        deadline = time.monotonic() + 60
        mirror: set[int] = set()
        while not expected <= mirror and time.monotonic() < deadline:
            for events in take():
                replay(mirror, events)
            time.sleep(0.02)
        assert expected <= mirror  # the prompt's three whole blocks
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # the engine thread's last drain after the last step
        for events in take():
            replay(mirror, events)
        driver.kv_snapshot()
        snapshots: list[list[KvEvent]] = []
        while not snapshots and time.monotonic() < deadline:
            snapshots = take()
            time.sleep(0.02)
        (snapshot,) = snapshots
        assert snapshot[0] == AllBlocksCleared()
        rebuilt: set[int] = {0}
        replay(rebuilt, snapshot)
        assert rebuilt == mirror
    finally:
        driver.stop()
        engine.shutdown()
