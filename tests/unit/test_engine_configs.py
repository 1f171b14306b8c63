"""The same greedy outputs whatever the cache, chunking or memory pressure."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from tests.unit.engine_helpers import engine_outputs, make_prompts

MAX_NEW = 32
LENGTHS = [5, 17, 40, 3, 64, 90, 33, 12]


def _run(model_dir: Path, **kwargs: object) -> tuple[Engine, list[list[int]]]:
    engine = Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )
    prompts = make_prompts(engine.runner.vocab_size, LENGTHS, seed=3)
    # Shared prefixes too, so the radix cache has something to reuse within the batch.
    prompts += [prompts[4][:50] + p for p in prompts[:3]]
    return engine, engine_outputs(engine, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Path) -> list[list[int]]:
    return _run(tiny_llama_dir, chunked_prefill_size=-1)[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 64},
        {"chunked_prefill_size": 16, "disable_radix_cache": True},
        {"enable_mixed_chunk": False, "chunked_prefill_size": 16},
        {"schedule_policy": "fcfs"},
        {"schedule_policy": "dfs-weight"},
        {"page_size": 4, "chunked_prefill_size": 16},
        {"page_size": 16, "enable_mixed_chunk": False, "chunked_prefill_size": 16},
        {"page_size": 16, "disable_radix_cache": True},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_same_outputs(
    tiny_llama_dir: Path, baseline: list[list[int]], kwargs: dict[str, object]
) -> None:
    engine, outs = _run(tiny_llama_dir, **kwargs)
    assert outs == baseline
    usage = engine.scheduler.usage()
    assert usage.in_flight_tokens == 0 and usage.protected_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_retraction_keeps_outputs(
    tiny_llama_dir: Path, baseline: list[list[int]], disable_radix_cache: bool
) -> None:
    # Room for the longest request alone but far from all of them at once.
    engine, outs = _run(
        tiny_llama_dir,
        max_total_tokens=200,
        chunked_prefill_size=32,
        disable_radix_cache=disable_radix_cache,
    )
    assert engine.scheduler.total_retractions > 0, "the pool was meant to force retraction"
    assert outs == baseline
    usage = engine.scheduler.usage()
    assert usage.free_tokens + usage.evictable_tokens == usage.pool_size


def test_batch_limits_follow_the_device_unless_set(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from radixserve.engine import runner
    from radixserve.engine.config import EngineConfig

    # On the CPU: 256 running; the resolved values are what the config then shows.
    engine = Engine(model_path=str(tiny_llama_dir), device="cpu", dtype="float32")
    assert engine.runner.max_running_requests == engine.config.max_running_requests == 256
    assert engine.config.cuda_graph_max_bs == 256
    engine.shutdown()
    # A set value stays, the other follows the device.
    engine = Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", max_running_requests=3
    )
    assert engine.runner.max_running_requests == 3 and engine.config.cuda_graph_max_bs == 256
    assert engine.runner.req_pool.max_reqs == 4  # one spare row for the request mid-chunk
    engine.shutdown()

    # A GPU by its memory (the device properties stand in for one here).
    class Props:
        total_memory = 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    cuda = torch.device("cuda", 0)
    for gib, limit in [(80, 512), (141, 512), (70, 512), (48, 256), (24, 256)]:
        Props.total_memory = gib * 1024**3
        assert runner.batch_limit(cuda) == limit
        config = EngineConfig(cuda_graph_max_bs=64)
        assert runner.resolve_batch_limits(config, cuda) == (limit, 64)
        assert (config.max_running_requests, config.cuda_graph_max_bs) == (limit, 64)
    with pytest.raises(ValueError, match="max_running_requests must be >= 1"):
        EngineConfig(max_running_requests=0)


def test_flags_say_what_an_unset_option_means() -> None:
    import argparse

    from radixserve.engine.flags import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["max_running_requests"] == "default: 512 on a GPU of 70 GiB or more, else 256"
    assert helps["cuda_graph_max_bs"] == "default: as max_running_requests"
    assert helps["chunked_prefill_size"] == "default 2048"
    assert "SmolLM2" in (helps["model_path"] or "")
