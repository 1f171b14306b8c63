"""The engine's collector policy (engine/heap.py): the started heap frozen out of the
cyclic collector's walks and the young generation's threshold raised; thawed at
shutdown; frozen garbage still reachable by `collect_all`."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine import heap
from tests.unit.engine_helpers import greedy_params, make_prompts


@pytest.fixture
def default_collector() -> Iterator[None]:
    """Nothing frozen and CPython's default thresholds, before and after the test."""
    saved = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(model_path=str(model_dir), device="cpu", dtype="float32", **kwargs)


@pytest.mark.usefixtures("default_collector")
def test_a_started_engine_freezes_its_heap_and_shutdown_thaws_it(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    model = weakref.ref(engine.runner.model)
    assert gc.get_freeze_count() > 10_000  # the model's modules, the tokenizer, ...
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    (ids,) = make_prompts(engine.runner.vocab_size, [12], seed=3)
    out = engine.generate(input_ids=ids, sampling_params=greedy_params(4))
    assert len(out["output_ids"]) == 4
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None


@pytest.mark.usefixtures("default_collector")
def test_disable_gc_freeze_leaves_the_collector_alone(tiny_llama_dir: Path) -> None:
    with _engine(tiny_llama_dir, disable_gc_freeze=True):
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.usefixtures("default_collector")
def test_a_higher_threshold_or_a_disabled_one_is_kept() -> None:
    gc.set_threshold(10 * heap.YOUNG_THRESHOLD, 10, 10)
    heap.settle_started_heap()
    assert gc.get_threshold()[0] == 10 * heap.YOUNG_THRESHOLD
    gc.set_threshold(0, 10, 10)  # the process's owner turned collection off
    heap.settle_started_heap()
    assert gc.get_threshold()[0] == 0


@pytest.mark.usefixtures("default_collector")
def test_frozen_garbage_waits_for_collect_all() -> None:
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    assert heap.settle_started_heap() == gc.get_freeze_count() > 0
    del cycle
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not walk it
    heap.collect_all()
    assert ref() is None and gc.get_freeze_count() == 0


@pytest.mark.usefixtures("default_collector")
def test_thawed_garbage_goes_with_the_next_full_collection() -> None:
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    heap.settle_started_heap()
    del cycle
    heap.thaw()
    gc.collect()
    assert ref() is None
