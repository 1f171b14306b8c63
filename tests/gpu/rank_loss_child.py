"""A tensor-parallel rank lost while rank 0 waits inside an all-reduce, run in a process
of its own by `test_tensor_parallel_cuda.py` (argv: the model folder, and "direct" or
"torch.distributed": which path enqueues the all-reduce). Exits 0 and prints "rank 0
stopped" when rank 0 got out of the wait, raised `RankLost` and shut down in time."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from radixserve import Engine
from radixserve.engine.tensor_parallel import RankLost, ReplicatedScheduler

OPTIONS = {"device": "cuda", "dtype": "float32", "max_total_tokens": 8192, "cuda_graph_max_bs": 8}


def main(model_dir: str, path: str) -> None:
    engine = Engine(model_dir, tp_size=2, **OPTIONS)
    try:
        scheduler = engine.scheduler
        assert isinstance(scheduler, ReplicatedScheduler)
        tp = engine.runner.tp
        x = torch.ones(4096, device=engine.runner.device)
        # Rank 1 waits for rank 0's next step (a host broadcast): it never joins this one.
        if path == "direct":
            assert tp.nccl is not None
            tp.nccl.all_reduce(x)
        else:
            dist.all_reduce(x, group=tp.group)
        (rank,) = scheduler.others.procs
        rank.kill()
        synced = threading.Event()
        waiter = threading.Thread(
            target=lambda: (torch.cuda.synchronize(engine.runner.device), synced.set()),
            daemon=True,
        )
        waiter.start()
        assert synced.wait(60), "rank 0 still waits in the all-reduce after 60 s"
        lost = scheduler.others.watch.lost
        assert lost is not None and "rank 1 exited" in lost, lost
        engine.submit([5, 6, 7], {"max_new_tokens": 2})
        with pytest.raises(RankLost, match="rank 1 exited"):
            engine.step()
    finally:
        started = time.monotonic()
        engine.shutdown()
        took = time.monotonic() - started
    assert took < 20, f"shutdown took {took:.1f} s"
    with pytest.raises(ValueError, match="lost a tensor-parallel rank"):
        Engine(model_dir, tp_size=2, **OPTIONS)
    print(f"rank 0 stopped; shutdown took {took:.1f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
