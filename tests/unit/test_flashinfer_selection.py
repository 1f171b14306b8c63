"""Choosing the flashinfer attention backend where FlashInfer cannot run: the config
accepts the name, the factory says how to get it, and "auto" never picks it on the CPU.
(tests/gpu/test_flashinfer_attention_cuda.py checks the backend itself.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.config import EngineConfig
from radixserve.engine.runner import make_attention_backend

CPU = torch.device("cpu")


@pytest.fixture
def without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import flashinfer` fails, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)


def test_config_accepts_flashinfer() -> None:
    assert EngineConfig(attention_backend="flashinfer").attention_backend == "flashinfer"


@pytest.mark.usefixtures("without_flashinfer")
def test_missing_flashinfer_says_how_to_get_it(tiny_llama_dir: Path) -> None:
    message = "flashinfer is not installed: pip install flashinfer-python"
    with pytest.raises(RuntimeError, match=message):
        make_attention_backend("flashinfer", CPU, torch.bfloat16)
    with pytest.raises(RuntimeError, match="--attention-backend triton"):
        Engine(model_path=str(tiny_llama_dir), device="cpu", attention_backend="flashinfer")


def test_flashinfer_needs_cuda() -> None:
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("flashinfer", CPU, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, None])
def test_auto_is_the_torch_reference_on_the_cpu(dtype: torch.dtype | None) -> None:
    assert isinstance(make_attention_backend("auto", CPU, dtype), TorchAttentionBackend)
