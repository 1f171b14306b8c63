"""Choosing the flashinfer attention backend where FlashInfer cannot run: the config
accepts the name, the factory says how to get it, and "auto" never picks it on the CPU.
(tests/gpu/test_flashinfer_attention_cuda.py checks the backend itself.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.config import EngineConfig
from radixserve.engine.runner import (
    FLASHINFER_HEAD_DIMS,
    attention_backend_names,
    make_attention_backend,
)
from tests.helpers.tiny_models import make_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture
def without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import flashinfer` fails, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)


def test_config_accepts_flashinfer() -> None:
    assert EngineConfig(attention_backend="flashinfer").attention_backend == "flashinfer"


@pytest.mark.usefixtures("without_flashinfer")
def test_missing_flashinfer_says_how_to_get_it(tmp_path: Path) -> None:
    message = "flashinfer is not installed: pip install flashinfer-python"
    with pytest.raises(RuntimeError, match=message):
        make_attention_backend("flashinfer", CPU, torch.bfloat16)
    model = make_tiny_llama(tmp_path, seed=0, head_dim=64)  # heads FlashInfer runs
    with pytest.raises(RuntimeError, match="--attention-backend triton"):
        Engine(model_path=str(model), device="cpu", attention_backend="flashinfer")


def test_flashinfer_refuses_heads_it_has_no_kernels_for(tiny_llama_dir: Path) -> None:
    """The tiny models' 16-element heads: an error at start-up, not at the first prefill."""
    for options in ({"name": "flashinfer"}, {"name": "triton", "prefill": "flashinfer"}):
        with pytest.raises(ValueError, match=r"heads of \(64, 128, 256\).* have 16"):
            make_attention_backend(device=CPU, dtype=torch.bfloat16, head_dim=16, **options)
    with pytest.raises(ValueError, match="use --attention-backend triton"):
        Engine(model_path=str(tiny_llama_dir), device="cpu", attention_backend="flashinfer")


@pytest.mark.parametrize("head_dim", [16, 96, *FLASHINFER_HEAD_DIMS, None])
def test_auto_passes_flashinfer_over_for_other_heads(
    monkeypatch: pytest.MonkeyPatch, head_dim: int | None
) -> None:
    """On CUDA with FlashInfer importable, "auto" prefills on it for the heads it runs
    (or heads not known), on Triton for the others."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flashinfer" else find_spec(name, *a),
    )
    names = attention_backend_names("auto", torch.device("cuda"), torch.bfloat16, head_dim=head_dim)
    fits = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    assert names == (("flashinfer", "triton") if fits else ("triton", "triton"))


def test_flashinfer_needs_cuda() -> None:
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("flashinfer", CPU, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, None])
def test_auto_is_the_torch_reference_on_the_cpu(dtype: torch.dtype | None) -> None:
    assert isinstance(make_attention_backend("auto", CPU, dtype), TorchAttentionBackend)
