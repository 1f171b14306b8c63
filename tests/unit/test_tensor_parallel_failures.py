"""A tensor-parallel engine that loses a rank stops at its next step instead of waiting
in a collective; a second one in the same process is refused (its own module: the other
tests keep an engine of two ranks for the whole module)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.engine import distributed
from radixserve.engine.tensor_parallel import (
    RankLost,
    ReplicatedScheduler,
    _exited,
    _wait_started,
)

pytestmark = pytest.mark.timeout(300)

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.mark.slow
def test_a_lost_rank_stops_the_engine_and_one_engine_runs_at_a_time(
    tiny_llama_dir: Path,
) -> None:
    engine = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    try:
        with pytest.raises(ValueError, match="already running in this process"):
            Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
        scheduler = engine.scheduler
        assert isinstance(scheduler, ReplicatedScheduler)
        (rank,) = scheduler.others.procs
        rank.kill()
        rank.join(30)
        # The watch sees it go by itself (on a GPU it would abort rank 0's collectives).
        deadline = time.monotonic() + 10
        while scheduler.others.watch.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (
            scheduler.others.watch.lost is not None
            and "rank 1 exited" in scheduler.others.watch.lost
        )
        engine.submit([5, 6, 7], {"max_new_tokens": 2})
        with pytest.raises(RankLost, match="rank 1 exited"):
            engine.step()
    finally:
        started = time.monotonic()
        engine.shutdown()  # returns: nothing is left to wait for
        assert time.monotonic() - started < 20
    # Shut down, the process can start another.
    again = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    try:
        out = again.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        assert isinstance(out, dict) and len(out["output_ids"]) == 2
    finally:
        again.shutdown()


@pytest.mark.slow
def test_a_script_without_a_main_guard_fails_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The ranks are spawned and import the caller's main module; without `if __name__ ==
    '__main__':` rank 1 dies importing it. Rank 0 says so at once instead of waiting out
    the group's rendezvous (10 minutes)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from radixserve import Engine\n"
        f"Engine({str(tiny_llama_dir)!r}, tp_size=2, device='cpu', dtype='float32', "
        "max_total_tokens=4096)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode != 0
    assert "rank 1 exited" in done.stderr and "__main__" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 200


def test_a_rank_that_never_starts_is_an_error_after_the_timeout() -> None:
    context = multiprocessing.get_context("spawn")
    proc = context.Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    try:
        with pytest.raises(RuntimeError, match="rank 1 did not start within 1 s"):
            _wait_started([proc], [context.Event()], timeout_s=1.0)
    finally:
        proc.kill()
        proc.join(10)


def test_a_rank_that_dies_before_joining_ends_rank_0s_rendezvous() -> None:
    """Rank 0 hosts the group's rendezvous: a rank that exits before it checks in (after
    it started) is an error within moments, not a wait of dist_timeout_s."""
    import torch

    context = multiprocessing.get_context("spawn")
    proc = context.Process(target=sys.exit, args=(3,), daemon=True)
    proc.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"before joining .*rank 1 exited \(code 3\)"):
        distributed.init_tp_group(
            0,
            2,
            distributed.free_tcp_address(),
            torch.device("cpu"),
            timeout_s=120.0,
            lost=lambda: _exited([proc]),
        )
    assert time.monotonic() - started < 30
    proc.join(10)
    assert not distributed.tp_group_active()


def test_ranks_that_never_join_are_named_after_the_timeout() -> None:
    import torch

    with pytest.raises(RuntimeError, match=r"ranks 1, 2 did not join the group within 1 s"):
        distributed.init_tp_group(
            0, 3, distributed.free_tcp_address(), torch.device("cpu"), 1.0, lost=lambda: None
        )


def test_too_few_gpus_is_an_error_before_any_rank_starts(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank r runs on the r-th GPU after the engine's device: without it, that rank would
    die after the group formed and rank 0 would wait in a collective for its timeout."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tp_size 2 from cuda:1 needs GPUs 1..2, but 2 are"):
        Engine(str(tiny_llama_dir), tp_size=2, **{**ENGINE, "device": "cuda:1"})
    with pytest.raises(ValueError, match=r"tp_size 4 from cuda:0 needs GPUs 0..3"):
        Engine(str(tiny_llama_dir), tp_size=4, **{**ENGINE, "device": "cuda"})
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("radixserve-tp")]


def test_a_process_that_aborted_nccl_starts_no_other_engine(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After rank 0 aborted its NCCL collectives (a rank lost on GPUs), a new
    tensor-parallel engine in the same process is refused before any rank starts."""
    aborted = threading.Event()
    aborted.set()
    monkeypatch.setattr(distributed, "_ABORTED", aborted)
    with pytest.raises(ValueError, match=r"lost a tensor-parallel rank.*start a new process"):
        Engine(str(tiny_llama_dir), tp_size=2, **ENGINE)
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_an_idle_engine_outlives_the_collective_timeout(tiny_llama_dir: Path) -> None:
    """The ranks wait for rank 0's next step on a pipe, without a timeout: an engine idle
    for longer than `dist_timeout_s` still runs. (They used to wait in a gloo broadcast,
    whose timeout took them down: an idle engine lost its ranks after 10 minutes.)"""
    params = {"max_new_tokens": 3, "temperature": 0}
    with Engine(str(tiny_llama_dir), tp_size=2, dist_timeout_s=3, **ENGINE) as engine:
        first = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
        time.sleep(5)
        scheduler = engine.scheduler
        assert isinstance(scheduler, ReplicatedScheduler)
        assert all(proc.is_alive() for proc in scheduler.others.procs)
        assert scheduler.others.watch.lost is None
        again = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert isinstance(first, dict) and isinstance(again, dict)
    assert again["output_ids"] == first["output_ids"] and len(first["output_ids"]) == 3
