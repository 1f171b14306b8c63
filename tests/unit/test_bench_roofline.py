"""bench/common/roofline.py: the floor of an offline run, counted by hand on small cases and
against an independent count of the 8B shared-prefix workload."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from radixserve.model_files.config import ModelConfig

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def roofline(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("common.roofline")


def _shape(roofline: ModuleType, **kw: int) -> object:
    base = dict(hidden=8, intermediate=16, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    return roofline.ModelShape(**{**base, **kw})


def test_one_request_counted_by_hand(roofline: ModuleType) -> None:
    shape = _shape(roofline)
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16: 512 per layer, 2 layers.
    assert shape.layer_params == 2 * (64 + 32 + 32 + 64 + 3 * 128)
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 2 * 2  # K+V, 2 heads, dim 2, bf16, 2 layers
    # Prompt 4 (none cached), 3 output tokens: 4 prompt tokens and 2 decode steps computed,
    # the head over 3 sampled tokens; prompt keys 1+2+3+4, decode keys 5+6.
    work = [roofline.RequestWork(prompt_len=4, cached_len=0, output_len=3)]
    floor = roofline.work_floor(shape, work, matmul_rate=1.0, bandwidth=1.0)
    assert floor.projections_s == 2 * shape.layer_params * 6 + 2 * 8 * 10 * 3
    per_key = 4 * 2 * 4 * 2  # 4 x head_dim x heads x layers
    assert floor.prefill_attention_s == per_key * 10
    assert floor.decode_attention_s == shape.kv_bytes_per_token * 11
    assert (
        floor.total_s == floor.projections_s + floor.prefill_attention_s + floor.decode_attention_s
    )


def test_cached_and_shared_positions_are_not_charged_in_full(roofline: ModuleType) -> None:
    shape = _shape(roofline)
    plain = roofline.RequestWork(prompt_len=6, cached_len=0, output_len=4)
    cached = roofline.RequestWork(prompt_len=6, cached_len=4, output_len=4)
    shared = roofline.RequestWork(prompt_len=6, cached_len=4, output_len=4, shared_len=4, sharers=4)
    a, b, c = (roofline.work_floor(shape, [w], 2.0, 3.0) for w in (plain, cached, shared))
    # Four fewer prompt tokens computed; their keys (1..4) are not attended again.
    assert a.projections_s - b.projections_s == 2 * shape.layer_params * 4 / 2.0
    assert a.prefill_attention_s - b.prefill_attention_s == 4 * 2 * 4 * 2 * (1 + 2 + 3 + 4) / 2.0
    assert b.decode_attention_s == a.decode_attention_s  # decode reads every key either way
    # Shared by 4: each of the 3 decode steps reads a quarter of the 4 shared positions.
    saved = 3 * 4 * (1 - 1 / 4) * shape.kv_bytes_per_token / 3.0
    assert b.decode_attention_s - c.decode_attention_s == pytest.approx(saved)
    # No output, no head, no decode.
    none = roofline.work_floor(shape, [roofline.RequestWork(6, 0, 0)], 1.0, 1.0)
    assert none.decode_attention_s == 0 and none.projections_s == 2 * shape.layer_params * 6


def test_a_step_is_bound_by_its_weight_read(roofline: ModuleType) -> None:
    shape = _shape(roofline)
    work = [roofline.RequestWork(prompt_len=4, cached_len=0, output_len=3)]  # 6 tokens
    per_token = 2 * shape.layer_params / 1.0  # matmul rate 1
    read = shape.layer_params * 2 / 0.5  # bandwidth 0.5: one read = 2 tokens' FLOPs
    bare = roofline.work_floor(shape, work, 1.0, 0.5)
    # Steps of 4 prompt tokens (FLOP-bound), then 1 and 1 decode rows (read-bound: each
    # costs the read, 2 tokens' worth), an empty step costs nothing.
    stepped = roofline.work_floor(shape, work, 1.0, 0.5, step_tokens=[4, 1, 0, 1])
    assert read == 2 * per_token
    assert stepped.projections_s == bare.projections_s + 2 * (read - per_token)
    assert stepped.decode_attention_s == bare.decode_attention_s
    # Steps that computed more than the requests did (a retraction's recompute) only add.
    assert roofline.work_floor(shape, work, 1.0, 0.5, [4, 1, 1, 5]).projections_s == (
        stepped.projections_s
    )


def test_the_8b_shared_prefix_floors(roofline: ModuleType) -> None:
    """64 groups x 16 requests (2048 + 128 prompt, 256 out) on Llama-3.1-8B's shape, counted
    token by token here; with the cache each group computes its prefix once and decodes
    over it together."""
    config = ModelConfig.from_dict(importlib.import_module("common").LLAMA_31_8B)
    shape = roofline.ModelShape.of_model(config, torch.bfloat16)
    assert shape.layer_params == 6_979_321_856  # Llama-3.1-8B less embeddings and head
    matmul, bandwidth = 760e12, 3.0e12

    def count(radix: bool) -> float:
        flops = keys_read = 0.0
        for member in range(16):
            cached = 2048 if radix and member else 0
            flops += 2 * shape.layer_params * (2176 - cached + 255) + 2 * 4096 * 128256 * 256
            flops += 4 * 128 * 32 * 32 * sum(p + 1 for p in range(cached, 2176))
            for step in range(255):
                keys = 2176 + step + 1
                keys_read += keys - (2048 * 15 / 16 if radix else 0)
        return 64 * (flops / matmul + keys_read * shape.kv_bytes_per_token / bandwidth)

    floors = {}
    for radix in (True, False):
        work = [
            roofline.RequestWork(2176, 2048 if radix and m else 0, 256, 2048 if radix else 0, 16)
            for _ in range(64)
            for m in range(16)
        ]
        floors[radix] = roofline.work_floor(shape, work, matmul, bandwidth)
        assert floors[radix].total_s == pytest.approx(count(radix), rel=1e-9)
    assert floors[True].total_s == pytest.approx(14.64, abs=0.01)
    assert floors[False].total_s == pytest.approx(74.04, abs=0.01)
    assert floors[False].total_s / floors[True].total_s == pytest.approx(5.058, abs=0.001)
