"""The FP8 KV cache on the CPU: the format (saturated e4m3 codes, per-layer scales), the
pool, the scales a checkpoint stores, the torch reference over an FP8 pool against the
same attention over the dequantized values, the pool's sizing, and the engine's greedy
tokens and logits against the 16-bit cache."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve import Engine
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.config import EngineConfig
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale, kv_cache_dtype, quantize, widen
from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.model.kv_scales import checkpoint_kv_scales
from radixserve.engine.runner import ModelRunner
from tests.helpers import attention_passes
from tests.helpers.fp8_kv import fp8_kv_greedy, model_steps
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.timeout(300)

SCALES = (KVScale(0.37, 1.9), KVScale(2.5, 0.11))  # the two layers of a test pass


# -- the format ---------------------------------------------------------------------------
def test_codes_are_saturated_scaled_e4m3() -> None:
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e9, 0.01])
    codes = quantize(x, 2.0)
    assert codes.dtype == FP8_DTYPE
    assert torch.equal(codes, (x / 2.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    assert codes.float()[3] == FP8_MAX and codes.float()[4] == -FP8_MAX  # no NaN, no inf
    back = widen(codes, 2.0, torch.float32)
    assert torch.equal(back, codes.float() * 2.0)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value.
    inside = x.abs() < FP8_MAX * 2.0
    assert ((back - x).abs()[inside] <= x.abs()[inside] / 16 + 2.0 * 2**-9).all()
    # A 16-bit pool's rows are only cast.
    assert widen(x.half(), 5.0, torch.float32).equal(x.half().float())


def test_config_flag_and_dtypes() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE
    import argparse

    from radixserve.engine.flags import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    ns = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert engine_kwargs(ns, {})["kv_cache_dtype"] == "fp8_e4m3"
    unset = parser.parse_args([])
    assert engine_kwargs(unset, {"RADIXSERVE_KV_CACHE_DTYPE": "fp8_e4m3"}) == {
        "kv_cache_dtype": "fp8_e4m3"
    }


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        KVScale(k=bad)


# -- the pool -----------------------------------------------------------------------------
def test_pool_stores_codes_and_writes_through_set_kv() -> None:
    pool = KVPool(16, 2, 2, 8, FP8_DTYPE, "cpu")
    assert pool.quantized and pool.k_buffers[0].dtype == FP8_DTYPE
    assert pool.scales == [UNIT_SCALE, UNIT_SCALE]
    pool.set_scales(list(SCALES))
    k, v = torch.randn(3, 2, 8) * 4, torch.randn(3, 2, 8)
    loc = torch.tensor([1, 5, 9])
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k_buffers[1][loc], quantize(k, SCALES[1].k))
    assert torch.equal(pool.v_buffers[1][loc], quantize(v, SCALES[1].v))
    assert pool.k_buffers[0].float().abs().sum() == 0  # the other layer untouched
    # What a kernel reading the new tokens from the projection must attend.
    k_read, v_read = pool.as_stored(1, k, v)
    assert torch.equal(k_read, widen(pool.k_buffers[1][loc], SCALES[1].k, k.dtype))
    assert torch.equal(v_read, widen(pool.v_buffers[1][loc], SCALES[1].v, v.dtype))
    # The rotary kernel's fused store casts unscaled: an FP8 pool refuses it.
    assert pool.kv_write(1, loc, v) is None


def test_scales_are_checked() -> None:
    pool = KVPool(16, 2, 1, 8, FP8_DTYPE, "cpu")
    with pytest.raises(ValueError, match="2 layers"):
        pool.set_scales([UNIT_SCALE])
    wide = KVPool(16, 2, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unscaled"):
        wide.set_scales(list(SCALES))
    wide.set_scales([UNIT_SCALE, UNIT_SCALE])
    assert wide.kv_write(0, torch.tensor([1]), torch.zeros(1, 1, 8)) is not None


def test_an_fp8_token_takes_half_the_bytes() -> None:
    args = (32, 8, 128)
    assert KVPool.bytes_per_token_for(*args, FP8_DTYPE) * 2 == KVPool.bytes_per_token_for(
        *args, torch.bfloat16
    )


def test_gpu_sizing_fits_twice_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's GPU budget (ModelRunner._gpu_kv_budget_tokens) with the device's free
    memory stubbed: the same bytes hold twice the FP8 tokens."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def tokens(kv_dtype: torch.dtype) -> int:
        runner = SimpleNamespace(
            config=EngineConfig(mem_fraction_static=0.5),
            model_config=SimpleNamespace(num_hidden_layers=32, head_dim=128),
            local_kv_heads=8,
            kv_dtype=kv_dtype,
            device=torch.device("cpu"),
        )
        return int(ModelRunner._gpu_kv_budget_tokens(runner))  # type: ignore[arg-type]

    # 20 GiB over 128 KiB (bf16) or 64 KiB (FP8) a token.
    assert tokens(torch.bfloat16) == 20 * 8 * 1024
    assert tokens(FP8_DTYPE) == 2 * tokens(torch.bfloat16)


# -- checkpoint scales --------------------------------------------------------------------
def test_checkpoint_scales_by_their_names(tmp_path: Path) -> None:
    one = torch.tensor(1.0)
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # compressed-tensors
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(2.0),  # ModelOpt
            "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(3.0),
            "model.layers.2.self_attn.kv_scale": torch.tensor(1.5),  # AutoFP8, both
            "model.layers.3.self_attn.k_proj.output_scale": torch.tensor(4.0),
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
            "model.layers.0.mlp.down_proj.input_scale": one,  # not a KV scale
        },
        str(tmp_path / "model.safetensors"),
    )
    scales = checkpoint_kv_scales(tmp_path, 5)
    assert scales == [
        KVScale(0.5, 0.25),
        KVScale(2.0, 3.0),
        KVScale(1.5, 1.5),
        KVScale(4.0, 1.0),
        UNIT_SCALE,
    ]


def test_per_head_scales_are_refused(tmp_path: Path) -> None:
    save_file(
        {"model.layers.0.self_attn.k_scale": torch.ones(4)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="per-tensor"):
        checkpoint_kv_scales(tmp_path, 1)


# -- the torch reference over an FP8 pool -------------------------------------------------
def _dequantized_twin(
    p: attention_passes.Pass, layer: int, **kwargs: object
) -> attention_passes.Pass:
    """The same pass (the same make_pass arguments) over a pool of q's dtype holding `p`'s
    FP8 pool dequantized, with the new K/V as the FP8 pool stores them."""
    twin = attention_passes.make_pass(**kwargs)  # type: ignore[arg-type]
    pool, ours = p.batch.kv_pool, twin.batch.kv_pool
    scale = pool.scales[layer]
    ours.k_buffers[layer].copy_(widen(pool.k_buffers[layer], scale.k, p.q.dtype))
    ours.v_buffers[layer].copy_(widen(pool.v_buffers[layer], scale.v, p.q.dtype))
    k, v = pool.as_stored(layer, p.k, p.v)
    return attention_passes.Pass(twin.batch, p.q, k, v, p.scale)


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "mode"),
    [
        ([0, 3, 40, 17], [1, 1, 1, 1], ForwardMode.DECODE),
        ([0, 12, 5], [9, 30, 1], ForwardMode.EXTEND),  # a mixed batch: a decoder beside
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_backend_attends_the_dequantized_values(
    prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode, dtype: torch.dtype
) -> None:
    """Bit for bit the same attention over the dequantized K/V in a pool of q's dtype:
    the same values reach the same SDPA (the widening rounds to q's dtype in both)."""
    kwargs = dict(
        prefix_lens=prefix_lens, extend_lens=extend_lens, device=torch.device("cpu"),
        mode=mode, dtype=dtype, seed=7, page_size=4,
    )  # fmt: skip
    p = attention_passes.make_pass(**kwargs, kv_dtype=FP8_DTYPE, kv_scales=SCALES)  # type: ignore[arg-type]
    ours = TorchAttentionBackend()
    ours.init_forward_metadata(p.batch)
    reference = TorchAttentionBackend()
    for layer in (0, 1):
        out = ours.forward(p.q, p.k, p.v, layer, p.batch, p.scale)
        twin = _dequantized_twin(p, layer, **kwargs)
        reference.init_forward_metadata(twin.batch)
        expected = reference.forward(twin.q, twin.k, twin.v, layer, twin.batch, twin.scale)
        assert out.dtype == dtype
        assert torch.equal(out, expected)
        # The codes carry the scale: the same pass read with unit scales differs.
        assert not torch.equal(
            p.batch.kv_pool.k_buffers[layer].float(), twin.batch.kv_pool.k_buffers[layer].float()
        )


# -- the model and the engine -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=3)


# FP8 K/V against float32 K/V on the tiny Llama, over the prompts' last tokens and 4
# decode steps each (4 prompt sets, unit scales), measured: relative Frobenius norm of
# the logits 4.8-6.9% (e4m3 rounds K and V by up to 1/16, ~3.6% RMS, through 3
# layers), largest difference 0.34-0.51 (the logits span ~10, std 1).
FP8_KV_LOGITS_RTOL = 0.10
FP8_KV_LOGITS_ATOL = 0.8
# Greedy tokens of the FP8 cache may part from the float32 model's only where the
# latter's top-2 gap is below what the logits' difference can swap: twice the largest.
FP8_KV_TIE = 2 * FP8_KV_LOGITS_ATOL
DECODE_STEPS = 4


def _logits(folder: Path, kv_dtype: torch.dtype, prompts: list[list[int]]) -> torch.Tensor:
    return torch.cat(model_steps(folder, kv_dtype, prompts, DECODE_STEPS, greedy=False))


def test_fp8_kv_logits_within_bound(tiny_dir: Path) -> None:
    prompts = make_prompts(1000, [5, 40, 23, 64], seed=1)
    wide = _logits(tiny_dir, torch.float32, prompts)
    fp8 = _logits(tiny_dir, FP8_DTYPE, prompts)
    assert 0 < float((fp8 - wide).norm() / wide.norm()) < FP8_KV_LOGITS_RTOL
    assert float((fp8 - wide).abs().max()) < FP8_KV_LOGITS_ATOL


def test_checkpoint_scales_reach_the_pool(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint with KV scales (compressed-tensors names): the logits change with
    them, and stay within the bound."""
    folder = tmp_path / "scaled"
    folder.mkdir()
    for item in tiny_dir.iterdir():
        if item.suffix != ".safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.125)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompts = make_prompts(1000, [30, 9], seed=2)
    wide = _logits(tiny_dir, torch.float32, prompts)
    unit = _logits(tiny_dir, FP8_DTYPE, prompts)
    scaled = _logits(folder, FP8_DTYPE, prompts)
    assert not torch.equal(scaled, unit)
    assert float((scaled - wide).norm() / wide.norm()) < FP8_KV_LOGITS_RTOL


@pytest.mark.slow
def test_engine_greedy_tokens_with_an_fp8_cache(tiny_dir: Path) -> None:
    """Through the engine (prefill chunks of 16, radix hits in a second round, decode
    steps): the FP8 cache's greedy tokens equal greedy decoding over an FP8 pool outside
    the engine but at float32 near-ties (every read widens the same codes, whatever the
    chunking: only the sums' order differs), and part from the float32 model's
    (transformers') only at its top-2 gaps below FP8_KV_TIE. The random model's gaps are
    small (0.01-0.5), so FP8 greedy text does part from float32's within a few tokens on
    some prompts (measured: at gaps of 0.12 or less)."""
    prompts = make_prompts(1000, [5, 23, 40, 11], seed=4)
    fp8_refs = fp8_kv_greedy(tiny_dir, prompts, 12)
    float_refs = hf_greedy(tiny_dir, prompts, 12)
    engine = Engine(
        model_path=str(tiny_dir),
        device="cpu",
        dtype="float32",
        kv_cache_dtype="fp8_e4m3",
        chunked_prefill_size=16,
        max_total_tokens=1024,
        debug_check_invariants=True,
    )
    try:
        assert engine.runner.kv_pool.quantized
        for _ in range(2):  # the second round hits the radix cache
            outs = engine_outputs(engine, prompts, 12)
            for ours, fp8_ref, float_ref in zip(outs, fp8_refs, float_refs, strict=True):
                assert_matches_reference(ours, fp8_ref)
                assert_matches_reference(ours, float_ref, tolerance=FP8_KV_TIE)
    finally:
        engine.shutdown()
