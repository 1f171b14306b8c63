"""`radixserve up` on a machine with GPUs gives each worker GPUs of its own (its
tp_size of them, in order, as CUDA_VISIBLE_DEVICES), refuses more workers than GPUs,
and pins nothing on the CPU or where the device names its GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixserve.infra.process import ManagedProcess
from radixserve.stack import StackSpec, worker_gpus


def _spec(tmp_path: Path, workers: int, per_worker: int, gpus: tuple[str, ...]) -> StackSpec:
    return StackSpec(
        nats_url="nats://x",
        redis_url="redis://x",
        subject_prefix="p",
        host="127.0.0.1",
        port=8000,
        workers=workers,
        model_dir=tmp_path,
        served_model_name="m",
        worker_args=[],
        tokenizer_args=[],
        log_dir=tmp_path,
        gpus_per_worker=per_worker,
        gpus=gpus,
    )


def test_each_worker_gets_its_own_gpus_in_order(tmp_path: Path) -> None:
    spec = _spec(tmp_path, workers=2, per_worker=2, gpus=("4", "5", "6", "7", "8"))
    assert spec.instance_env("worker-0") == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert spec.instance_env("worker-1") == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert spec.instance_env("scheduler-0") == {}
    unpinned = _spec(tmp_path, workers=3, per_worker=0, gpus=())
    assert unpinned.instance_env("worker-2") == {}


def test_more_gpus_than_visible_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 worker\\(s\\) of 2 GPU\\(s\\) each need 4 GPUs; 3"):
        _spec(tmp_path, workers=2, per_worker=2, gpus=("0", "1", "2"))


def test_cpu_and_an_explicit_gpu_are_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert worker_gpus("cpu", 1) == (0, ())
    assert worker_gpus("cuda:3", 2) == (0, ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_gpus("auto", 1) == (0, ())


def test_gpus_visible_to_the_stack_follow_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3,5")
    assert worker_gpus("cuda", 2) == (2, ("2", "3", "5"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker_gpus("auto", 1) == (1, ("0", "1"))


def test_a_managed_process_gets_its_extra_environment(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], 'PATH' in os.environ)"
    proc = ManagedProcess("child", [sys.executable, "-c", code], log, {"CUDA_VISIBLE_DEVICES": "6"})
    proc.start()
    try:
        assert proc._popen is not None and proc._popen.wait(timeout=30) == 0
    finally:
        proc.stop(timeout_s=5)
    assert log.read_text().split() == ["6", "True"]
