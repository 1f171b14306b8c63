"""A tensor-parallel engine that loses a rank stops at its next step instead of waiting
in a collective; a second one in the same process is refused (its own module: the other
tests keep an engine of two ranks for the whole module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine.tensor_parallel import RankLost, ReplicatedScheduler

pytestmark = pytest.mark.timeout(300)

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


def test_a_lost_rank_stops_the_engine_and_one_engine_runs_at_a_time(
    tiny_llama_dir: Path,
) -> None:
    engine = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    try:
        with pytest.raises(ValueError, match="already running in this process"):
            Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
        scheduler = engine.scheduler
        assert isinstance(scheduler, ReplicatedScheduler)
        (rank,) = scheduler.ranks
        rank.kill()
        rank.join(30)
        engine.submit([5, 6, 7], {"max_new_tokens": 2})
        with pytest.raises(RankLost, match="rank 1 exited"):
            engine.step()
    finally:
        engine.shutdown()  # returns: nothing is left to wait for
    # Shut down, the process can start another.
    again = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    try:
        out = again.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        assert isinstance(out, dict) and len(out["output_ids"]) == 2
    finally:
        again.shutdown()
