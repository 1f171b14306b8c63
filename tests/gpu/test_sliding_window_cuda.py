"""Sliding windows and soft-caps on CUDA.

Kernels: the triton and flashinfer backends against the torch reference (which the CPU
suite checks against transformers' mask) on random bfloat16 passes at Llama-3-8B's
heads (32/8, head dim 128): decode over long sequences, extend over cached prefixes the
window cuts into, mixed batches, windowed, capped and full layers in one pass.

Engine: tiny random Mistral (a window on every layer), Qwen2 (use_sliding_window),
Gemma 2 (soft-caps) and Gemma 3 (local rope) with head dim 128, on each backend with
and without decode CUDA graphs, greedy tokens equal to transformers' eager generate
on the GPU (float32); a second batch extends the first's prompts (radix hits); prefill
chunks of 16 tokens put decoders beside them. FlashInfer runs half precision: bfloat16
there, with the bfloat16 tie tolerance of test_flashinfer_attention_cuda.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve import Engine
from radixserve.engine.attention.base import FULL_ATTENTION, AttentionBackend, LayerAttention
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers import attention_passes
from tests.helpers.tiny_models import (
    make_tiny_gemma2,
    make_tiny_gemma3,
    make_tiny_mistral,
    make_tiny_qwen2_window,
)
from tests.unit.engine_helpers import (
    Reference,
    assert_matches_reference,
    greedy_params,
    hf_greedy,
    make_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here"),
]

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
DEVICE = torch.device("cuda")
HEAD_DIM = 128
# Worst |backend - torch| over max |torch| in bfloat16 (test_flashinfer_attention_cuda's).
TOLERANCE = 1e-2
BF16_TIE_TOLERANCE = 0.5
# Layers 0 and 1 of one pass: windows long and short, a cap on a full and a windowed one.
LAYERS = {
    "windows": (LayerAttention(window=1000), LayerAttention(window=100)),
    "soft_cap": (FULL_ATTENTION, LayerAttention(soft_cap=30.0)),
    "both": (LayerAttention(window=4096, soft_cap=50.0), LayerAttention(window=37, soft_cap=5.0)),
}


def _backend(name: str) -> AttentionBackend:
    if name == "flashinfer":
        if not HAS_FLASHINFER:
            pytest.skip("flashinfer is not installed")
        from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(DEVICE, torch.bfloat16)
    return TritonAttentionBackend(DEVICE)


def _error(name: str, kind: str, prefix: list[int], extend: list[int], mode: ForwardMode) -> float:
    """Against the float32 reference on the same bfloat16 values: the bfloat16 one
    rounds its scores before the cap, 1.2% off at a 2000-token prefill."""
    shape: dict[str, Any] = dict(device=DEVICE, heads=32, kv_heads=8, head_dim=HEAD_DIM, mode=mode)
    p = attention_passes.make_pass(prefix, extend, dtype=torch.bfloat16, seed=len(prefix), **shape)
    twin = attention_passes.make_pass(
        prefix, extend, dtype=torch.float32, seed=len(prefix), **shape
    )
    exact = attention_passes.float32_twin(p, twin)
    return attention_passes.compare_with_torch(p, _backend(name), (0, 1), LAYERS[kind], exact)


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_decode_matches_torch(name: str, kind: str) -> None:
    prefix = [4095, 1, 17, 1000, 2047, 300, 0, 99]
    assert _error(name, kind, prefix, [1] * 8, ForwardMode.DECODE) < TOLERANCE


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize(
    "prefix,extend",
    [([0, 0], [2000, 77]), ([1500, 90, 0], [700, 300, 513]), ([3000, 0, 45, 1], [1, 900, 1, 300])],
    ids=["prefill", "cached_prefix", "mixed"],
)
def test_extend_matches_torch(name: str, kind: str, prefix: list[int], extend: list[int]) -> None:
    assert _error(name, kind, prefix, extend, ForwardMode.EXTEND) < TOLERANCE


# -- the engine against transformers -------------------------------------------------
BUILDERS: dict[str, Callable[..., Path]] = {
    "mistral": make_tiny_mistral,
    "qwen2": make_tiny_qwen2_window,
    "gemma2": make_tiny_gemma2,
    "gemma3": make_tiny_gemma3,
}
MAX_NEW = 20
# backend -> engine dtype; FlashInfer runs half precision only.
BACKENDS = {"torch": "float32", "triton": "float32", "flashinfer": "bfloat16"}


@pytest.fixture(scope="module")
def rounds(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[tuple[list[list[int]], list[Reference]]]]]:
    """Per model: its folder and two batches with their references (the second's prompts
    extend the first's, so they hit the radix cache past the window)."""
    from transformers import AutoConfig

    out = {}
    for name, build in BUILDERS.items():
        folder = build(tmp_path_factory.mktemp(f"tiny_{name}_cuda"), seed=3, head_dim=HEAD_DIM)
        vocab = int(AutoConfig.from_pretrained(folder).vocab_size)
        first = make_prompts(vocab, [41, 7, 23, 66, 3], seed=21)
        tails = make_prompts(vocab, [5, 12, 30], seed=22)
        second = [first[0] + tails[0], first[3] + tails[1], tails[2]]
        out[name] = (
            folder,
            [
                (p, hf_greedy(folder, p, MAX_NEW, device="cuda", attn_implementation="eager"))
                for p in (first, second)
            ],
        )
    return out


def _grid() -> list[Any]:
    return [
        pytest.param(model, backend, graphs, id=f"{model}-{backend}-graphs_{graphs}")
        for model in BUILDERS
        for backend in BACKENDS
        for graphs in (True, False)
    ]


@pytest.mark.parametrize(("model", "backend", "graphs"), _grid())
def test_greedy_tokens_equal_transformers(
    rounds: dict[str, tuple[Path, list[tuple[list[list[int]], list[Reference]]]]],
    model: str,
    backend: str,
    graphs: bool,
) -> None:
    if backend == "flashinfer" and not HAS_FLASHINFER:
        pytest.skip("flashinfer is not installed")
    folder, batches = rounds[model]
    dtype = BACKENDS[backend]
    tolerance = BF16_TIE_TOLERANCE if dtype == "bfloat16" else 1e-4
    with Engine(
        model_path=str(folder),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
        chunked_prefill_size=16,
        max_total_tokens=8192,
        debug_check_invariants=True,
    ) as engine:
        if graphs and engine.runner.graphs is None:
            pytest.skip(f"the {backend} backend has no CUDA graphs")
        assert not engine.runner.cascade  # windows and caps turn cascade off
        cached = 0
        for prompts, refs in batches:
            outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(MAX_NEW))
            assert isinstance(outs, list)
            for out, ref in zip(outs, refs, strict=True):
                assert_matches_reference(out["output_ids"], ref, tolerance=tolerance)
            cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    assert cached >= 41 + 66  # the second batch found the first's prompts
    assert replays > 0 if graphs else replays == 0
