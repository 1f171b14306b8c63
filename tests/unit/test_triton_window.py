"""The triton backend's sliding windows and soft-caps against the torch reference (which
test_sliding_window checks against transformers' mask): decode with split KV, extend over
cached prefixes the window cuts into, mixed batches, pages of 4, float16. On the CPU the
kernels run under the Triton interpreter (TRITON_INTERPRET is set before they import)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.attention.base import FULL_ATTENTION, LayerAttention
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.attention.triton_ops.decode import num_kv_splits
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers import attention_passes
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda

skip_unless_interpreted_or_cuda()

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
FP32_MAX_REL_ERROR = 1e-4
# Per kind, layers 0 and 1 of one pass (the pool has two): windows of several lengths,
# a full layer beside a capped one, windowed and capped together.
LAYERS = {
    "window": (LayerAttention(window=37), LayerAttention(window=8)),
    "soft_cap": (FULL_ATTENTION, LayerAttention(soft_cap=1.5)),
    "both": (LayerAttention(64, 1.0), LayerAttention(5, 2.0)),
}


def _compare(prefix_lens: list[int], extend_lens: list[int], kind: str, **kwargs: object) -> float:
    p = attention_passes.make_pass(prefix_lens, extend_lens, device=DEVICE, **kwargs)  # type: ignore[arg-type]
    backend = TritonAttentionBackend(DEVICE)
    return attention_passes.compare_with_torch(p, backend, (0, 1), LAYERS[kind])


@pytest.mark.parametrize("kind", list(LAYERS))
def test_decode_matches_torch(kind: str) -> None:
    # 300 keys: 2 splits over a window's few keys (empty trailing splits) and over the
    # sequences shorter than the window.
    assert num_kv_splits(300) == 2
    prefix_lens = [0, 3, 7, 36, 63, 299]
    error = _compare(prefix_lens, [1] * 6, kind, mode=ForwardMode.DECODE, seed=2)
    assert error < FP32_MAX_REL_ERROR


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_matches_torch(kind: str, page_size: int) -> None:
    # New tokens over no prefix, over prefixes shorter and longer than the windows,
    # several query blocks each; and a decoding request beside them (mixed batch).
    prefix_lens = [0, 5, 50, 90, 12]
    extend_lens = [45, 20, 33, 3, 1]
    error = _compare(prefix_lens, extend_lens, kind, page_size=page_size, seed=3 + page_size)
    assert error < FP32_MAX_REL_ERROR


def test_float16_within_tolerance() -> None:
    error = _compare([0, 40, 7], [30, 1, 9], "both", dtype=torch.float16, seed=5)
    assert error < 5e-3


def test_a_hybrid_sets_both_sides_and_refuses_with_them() -> None:
    from radixserve.engine.attention.hybrid import HybridAttentionBackend
    from radixserve.engine.attention.torch_backend import TorchAttentionBackend

    hybrid = HybridAttentionBackend(TorchAttentionBackend(), TritonAttentionBackend(DEVICE))
    layers = (FULL_ATTENTION, LayerAttention(window=8, soft_cap=3.0))
    hybrid.set_layers(layers)
    assert hybrid.prefill.layers == hybrid.decode.layers == hybrid.layers == layers
    assert not hybrid.supports_shared_prefix  # cascade off on the triton side


@pytest.mark.slow
def test_engine_greedy_gemma2_equals_the_torch_backend(tmp_path: Path) -> None:
    """Gemma 2 (windowed and full layers, attention soft-cap) through the engine on the
    triton backend: chunks of 16 put chunk continuations over cached prefixes longer than
    the window and mixed batches through both kernels, then decode steps."""
    from radixserve import Engine
    from tests.helpers.tiny_models import make_tiny_gemma2
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    model_dir = make_tiny_gemma2(tmp_path / "gemma2", seed=11)

    def outputs(backend: str) -> list[list[int]]:
        engine = Engine(
            model_path=str(model_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            chunked_prefill_size=16,
            max_total_tokens=512,
        )
        try:
            return engine_outputs(engine, prompts, 6)
        finally:
            engine.shutdown()

    prompts = make_prompts(1000, [5, 23, 40], seed=4)
    assert outputs("triton") == outputs("torch")
