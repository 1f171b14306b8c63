"""The triton backend over FP8 KV pools against the torch reference on the same pools
(which test_fp8_kv checks against attention over the dequantized values): decode with
split KV and in one split, extend over cached prefixes with the new tokens read as the
pool stores them, mixed batches, cascade over shared prefixes, a window and a soft-cap,
pages of 4, float16; per-layer scales that are not 1. On the CPU the kernels run under
the Triton interpreter (TRITON_INTERPRET is set before they import)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.attention.base import FULL_ATTENTION, LayerAttention
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.attention.triton_ops.decode import num_kv_splits
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.kvcache.fp8 import KVScale
from tests.helpers import attention_passes
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda

skip_unless_interpreted_or_cuda()

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
# Both sides read the same codes times the same scales (float32 products): what is left
# is the sums' order, as in test_triton_attention.
FP32_MAX_REL_ERROR = 1e-4
FP16_MAX_REL_ERROR = 5e-3
SCALES = (KVScale(0.37, 1.9), KVScale(2.5, 0.11))


def _compare(
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    groups: list[tuple[int, list[int]]] | None = None,
    attention: tuple[LayerAttention, ...] = (),
    **kwargs: Any,
) -> float:
    p = attention_passes.make_pass(
        prefix_lens, extend_lens, device=DEVICE, kv_dtype=FP8_DTYPE, kv_scales=SCALES, **kwargs
    )
    assert p.batch.kv_pool.quantized
    if groups is not None:
        attention_passes.share_prefixes(p, groups)
    backend = TritonAttentionBackend(DEVICE)
    return attention_passes.compare_with_torch(p, backend, (0, 1), attention)


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_with_split_kv(page_size: int) -> None:
    # 600 keys -> 4 splits; the 1- and 2-key requests leave trailing splits empty.
    assert num_kv_splits(600) == 4
    prefix_lens = [0, 1, 36, 299, 599]
    error = _compare(prefix_lens, [1] * 5, mode=ForwardMode.DECODE, page_size=page_size, seed=1)
    assert error < FP32_MAX_REL_ERROR


def test_decode_in_one_split() -> None:
    # Short sequences: one split, written straight to the output (DIRECT).
    assert num_kv_splits(70) == 1
    error = _compare([0, 9, 69], [1] * 3, mode=ForwardMode.DECODE, seed=2)
    assert error < FP32_MAX_REL_ERROR


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_over_cached_prefixes(page_size: int) -> None:
    # 70 new tokens span several query and key blocks; 130 prefix keys several blocks.
    # The new tokens' own keys come from q/k/v (as the pool stores them), the prefix's
    # from the pool: the reference reads both from the pool.
    error = _compare([0, 33, 130], [40, 70, 2], page_size=page_size, seed=3 + page_size)
    assert error < FP32_MAX_REL_ERROR


def test_mixed_batch() -> None:
    error = _compare([50, 0, 7, 20, 0], [1, 45, 1, 3, 1], seed=5)
    assert error < FP32_MAX_REL_ERROR


def test_shared_prefix_cascade() -> None:
    # Group A of 3 members over 300 shared slots, group B of 2 over 8, one request alone.
    prefix_lens = [370, 8, 40, 300, 20, 331]
    groups = [(300, [3, 0, 5]), (8, [4, 1])]
    error = _compare(prefix_lens, [1] * 6, mode=ForwardMode.DECODE, groups=groups, seed=11)
    assert error < FP32_MAX_REL_ERROR


def test_shared_prefix_decodes_beside_prefills() -> None:
    # Five leading decoders run cascade, the prefills after them the extend kernel.
    groups = [(300, [3, 0]), (8, [4, 1])]
    prefix_lens, extend_lens = [370, 8, 40, 300, 20, 0, 16], [1, 1, 1, 1, 1, 45, 3]
    error = _compare(prefix_lens, extend_lens, groups=groups, page_size=4, seed=31)
    assert error < FP32_MAX_REL_ERROR


def test_window_and_soft_cap() -> None:
    layers = (LayerAttention(window=37), LayerAttention(window=8, soft_cap=2.0))
    decode = _compare([0, 7, 36, 299], [1] * 4, mode=ForwardMode.DECODE, attention=layers, seed=6)
    extend = _compare([0, 5, 50], [45, 20, 1], attention=layers, seed=7)
    assert max(decode, extend) < FP32_MAX_REL_ERROR


def test_float16() -> None:
    for mode, extend_lens in [(ForwardMode.EXTEND, [12, 1, 30]), (ForwardMode.DECODE, [1, 1, 1])]:
        error = _compare([0, 20, 64], extend_lens, dtype=torch.float16, mode=mode, seed=3)
        assert error < FP16_MAX_REL_ERROR


def test_full_attention_default_scales() -> None:
    # Unit scales (a checkpoint without any): the codes are the values.
    p = attention_passes.make_pass([0, 40], [30, 1], device=DEVICE, kv_dtype=FP8_DTYPE, seed=9)
    backend = TritonAttentionBackend(DEVICE)
    error = attention_passes.compare_with_torch(p, backend, (0, 1), (FULL_ATTENTION,) * 2)
    assert error < FP32_MAX_REL_ERROR


@pytest.mark.slow
def test_engine_greedy_equals_the_torch_backend(tmp_path: Path) -> None:
    """Both backends over an FP8 cache through the engine: prefill chunks of 16 (chunk
    continuations over cached prefixes, mixed batches), then decode steps; a second
    round hits the radix cache (cascade over the shared prompt prefixes)."""
    from radixserve import Engine
    from tests.helpers.tiny_models import make_tiny_llama
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    model_dir = make_tiny_llama(tmp_path / "llama", seed=3)
    common = make_prompts(1000, [20], seed=8)[0]
    prompts = [common + tail for tail in make_prompts(1000, [5, 23, 9], seed=4)]

    def outputs(backend: str) -> list[list[int]]:
        engine = Engine(
            model_path=str(model_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            kv_cache_dtype="fp8_e4m3",
            chunked_prefill_size=16,
            max_total_tokens=512,
        )
        try:
            return [out for _ in range(2) for out in engine_outputs(engine, prompts, 6)]
        finally:
            engine.shutdown()

    assert outputs("triton") == outputs("torch")
