"""One backend for decode passes, another for the rest (attention/hybrid.py): the names
"auto" and the two per-pass options resolve to, the routing of each pass, and an engine
on a torch + triton pair giving the torch backend's greedy tokens. On the CPU the Triton
kernels run under the interpreter (see test_triton_attention.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine import runner
from radixserve.engine.attention.hybrid import HybridAttentionBackend
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.config import EngineConfig
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.runner import attention_backend_names, make_attention_backend
from tests.helpers import attention_passes
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda

skip_unless_interpreted_or_cuda()

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("field", ["prefill_attention_backend", "decode_attention_backend"])
def test_config_checks_the_per_pass_backends(field: str) -> None:
    assert getattr(EngineConfig(**{field: "triton"}), field) == "triton"
    assert getattr(EngineConfig(), field) is None
    for bad in ("auto", "cudnn"):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})


def test_auto_decodes_with_triton_where_it_prefills_with_flashinfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "_auto_backend", lambda device, dtype, head_dim: "flashinfer")
    assert attention_backend_names("auto", CUDA) == ("flashinfer", "triton")
    # Named backends run every pass, unless a per-pass option says otherwise.
    assert attention_backend_names("flashinfer", CUDA) == ("flashinfer", "flashinfer")
    assert attention_backend_names("auto", CUDA, decode="flashinfer") == ("flashinfer",) * 2
    assert attention_backend_names("triton", CUDA, prefill="flashinfer") == (
        "flashinfer",
        "triton",
    )
    monkeypatch.setattr(runner, "_auto_backend", lambda device, dtype, head_dim: "triton")
    assert attention_backend_names("auto", CUDA) == ("triton", "triton")
    assert attention_backend_names("auto", CUDA, prefill="torch") == ("torch", "triton")


def test_factory_builds_a_hybrid_only_for_two_backends() -> None:
    assert isinstance(
        make_attention_backend("triton", DEVICE, decode="triton"), TritonAttentionBackend
    )
    hybrid = make_attention_backend("torch", DEVICE, decode="triton")
    assert isinstance(hybrid, HybridAttentionBackend)
    assert isinstance(hybrid.prefill, TorchAttentionBackend)
    assert isinstance(hybrid.decode, TritonAttentionBackend)
    assert hybrid.name == "torch+triton"
    # Graphs capture decode passes (triton's); cascade needs both sides (torch has none).
    assert hybrid.supports_cuda_graph and not hybrid.supports_shared_prefix
    reverse = make_attention_backend("triton", DEVICE, decode="torch")
    assert reverse.name == "triton+torch"
    assert not reverse.supports_cuda_graph
    pair = HybridAttentionBackend(TritonAttentionBackend(DEVICE), TritonAttentionBackend(DEVICE))
    assert pair.supports_shared_prefix


class _Recording(TorchAttentionBackend):
    """The torch backend, noting the mode of every pass it plans."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[ForwardMode] = []

    def init_forward_metadata(self, batch: Any) -> None:
        self.modes.append(batch.mode)
        super().init_forward_metadata(batch)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_each_pass_runs_on_its_side_and_matches_torch(mode: ForwardMode) -> None:
    prefill, decode = _Recording(), _Recording()
    hybrid = HybridAttentionBackend(prefill, decode)
    # Every request adds one token: an EXTEND batch of them is still a prefill pass.
    p = attention_passes.make_pass([0, 7, 30], [1, 1, 1], device=DEVICE, mode=mode, seed=3)
    error = attention_passes.compare_with_torch(p, hybrid, (1,))
    assert error < 1e-5
    ran, idle = (decode, prefill) if mode == ForwardMode.DECODE else (prefill, decode)
    assert ran.modes == [mode] and idle.modes == []


def test_forward_before_metadata_is_an_error() -> None:
    hybrid = HybridAttentionBackend(TorchAttentionBackend(), TorchAttentionBackend())
    p = attention_passes.make_pass([0], [3], device=DEVICE, seed=0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        hybrid.forward(p.q, p.k, p.v, 1, p.batch, p.scale)


@pytest.mark.slow
def test_engine_on_a_torch_prefill_and_triton_decode_equals_the_torch_backend(
    tiny_llama_dir: Path,
) -> None:
    # Chunks of 16 put chunk continuations and mixed batches through the prefill side,
    # then decode steps through Triton's kernel.
    from radixserve import Engine
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    def outputs(**backends: str) -> tuple[list[list[int]], str]:
        engine = Engine(
            model_path=str(tiny_llama_dir),
            device=DEVICE.type,
            dtype="float32",
            chunked_prefill_size=16,
            max_total_tokens=512,
            **backends,
        )
        try:
            return engine_outputs(engine, prompts, 6), engine.runner.attn.name
        finally:
            engine.shutdown()

    prompts = make_prompts(1000, [5, 23, 40], seed=4)
    reference, name = outputs(attention_backend="torch")
    assert name == "torch"
    hybrid, name = outputs(attention_backend="torch", decode_attention_backend="triton")
    assert name == "torch+triton"
    assert hybrid == reference
