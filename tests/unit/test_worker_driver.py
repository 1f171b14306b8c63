"""The engine thread's driver: a flush the asking side gave up on (its future cancelled
while queued, as `asyncio.wait_for` does on timeout) is skipped, not answered into a
cancelled future, which raised InvalidStateError in the engine thread and stopped it."""

from __future__ import annotations

from pathlib import Path

from radixserve import Engine
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
