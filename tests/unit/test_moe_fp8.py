"""FP8 experts (issue 58): the fused Triton MoE kernel with FP8 experts under the Triton
interpreter against a float64 reference over the dequantized tokens and experts (W8A8:
each launch's input rows quantized per row); the torch reference loop against itself on
the dequantized experts; tiny Mixtral, Qwen2-MoE and Qwen3-MoE quantized on load
against their 16-bit selves; "fp8" and compressed-tensors checkpoints with FP8 experts
loaded as stored and against transformers on the dequantized weights (logits, greedy
tokens), over two tensor-parallel ranks as over one; block-wise expert scales refused.

TRITON_INTERPRET is set before anything imports the kernels (as test_moe_kernels.py).
Bounds: float32 to summation order (the reference quantizes the same rows the kernel
does); in bfloat16 a gate or up value the float32 sums round to the other side of a
bfloat16 tie moves its activation's code, so the bound is test_moe_kernels.py's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve import Engine
from radixserve.engine.kernels.activation import silu_and_mul_torch
from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize, quantize_rows
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.kernels.moe import fused_moe, fused_moe_torch, select_experts
from radixserve.engine.kernels.triton_ops.fused_moe import fused_moe_triton
from radixserve.engine.model.loader import load_model
from radixserve.engine.model.moe import SparseMoEBlock
from radixserve.engine.model.quantization import Fp8Linear
from tests.helpers.fp8_checkpoints import write_dequantized, write_fp8_method
from tests.helpers.tiny_models import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe
from tests.helpers.triton_interpreter import kernel_test_device
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)
from tests.unit.test_fp8_model import (
    SAME_WEIGHTS_RTOL,
    _last_logits,
    _reference_logits,
    _relative_error,
)

pytestmark = pytest.mark.timeout(300)

DEVICE = kernel_test_device(round_bf16=True)
LENGTHS = [5, 23, 1, 17]
MAX_NEW = 16
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
# --quantization fp8 against the 16-bit model (relative Frobenius norm of the last-token
# logits): e4m3 per row moves each expert by ~2.5% as it does a dense weight, and a
# token whose router scores move past each other takes another expert; measured on the
# 3-layer tiny models: Mixtral 0.142, Qwen2-MoE 0.117, Qwen3-MoE 0.082 (the dense tiny
# Llama's 0.085, test_fp8_model.py).
FP8_LOGITS_RTOL = 0.2
MAKERS = {
    "mixtral": (make_tiny_mixtral, 5),
    "qwen2_moe": (make_tiny_qwen2_moe, 6),
    "qwen3_moe": (make_tiny_qwen3_moe, 7),
}

# (tokens, experts, top_k, hidden, expert intermediate): odd sizes cross the tiles' edges.
SHAPES = [
    (1, 4, 1, 64, 32),
    (3, 8, 2, 33, 17),
    (7, 4, 2, 64, 48),
    (20, 8, 3, 40, 24),  # more tokens than experts: the larger tiles
]


def _stacked_fp8(w: torch.Tensor) -> Fp8Weight:
    experts, rows, k = w.shape
    codes, scale = quantize_rows(w.reshape(experts * rows, k))
    return Fp8Weight(codes.view(experts, rows, k), scale.view(experts, rows))


def _wide(weight: Fp8Weight, expert: int) -> torch.Tensor:
    return weight.data[expert].double() * weight.scale[expert].double()[:, None]


def _case(
    tokens: int, experts: int, top_k: int, hidden: int, n: int, dtype: torch.dtype, seed: int
) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w13 = _stacked_fp8(torch.randn(experts, 2 * n, hidden, generator=gen) * hidden**-0.5)
    w2 = _stacked_fp8(torch.randn(experts, hidden, n, generator=gen) * n**-0.5)
    w13, w2 = (Fp8Weight(w.data.to(DEVICE), w.scale.to(DEVICE)) for w in (w13, w2))
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, ids = select_experts(logits, top_k, top_k > 1, dtype)
    return x, w13, w2, weights, ids


def _w8a8_reference(
    x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """float64 [tokens, hidden]: each (token, slot) through its expert on the dequantized
    codes, x and the activations quantized per row as the kernel's inputs are, rounded
    to x's dtype where the kernel rounds (gate and up, silu_mul, down, x weight)."""
    dtype = x.dtype
    codes, scale = quantize_rows(x)
    xq = codes.double() * scale.double()[:, None]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = (xq[t : t + 1] @ _wide(w13, e).t()).to(dtype)
            act = silu_and_mul_torch(gate_up)
            act_codes, act_scale = quantize_rows(act)
            aq = act_codes.double() * act_scale.double()[:, None]
            down = (aq @ _wide(w2, e).t()).to(dtype).to(torch.float32) * weights[t, k].float()
            out[t] += down.to(dtype)[0].double()
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_fp8_experts_match_the_w8a8_reference(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x, w13, w2, weights, ids = _case(*shape, dtype=dtype, seed=sum(shape))
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    reference = _w8a8_reference(x, w13, w2, weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), reference, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), reference, atol=2e-2, rtol=1e-2)


def test_triton_fp8_experts_beside_16_bit_ones() -> None:
    """Each launch takes its own kind: FP8 gate_up with a 16-bit down, and the reverse."""
    x, w13, w2, weights, ids = _case(7, 4, 2, 64, 48, torch.float32, seed=9)
    wide13 = torch.stack([_wide(w13, e) for e in range(4)]).float()
    wide2 = torch.stack([_wide(w2, e) for e in range(4)]).float()
    both = fused_moe_triton(x, w13, w2, weights, ids)
    for pair in ((w13, wide2), (wide13, w2)):
        got = fused_moe_triton(x, *pair, weights, ids)
        torch.testing.assert_close(got, both, atol=0.05, rtol=0.05)
        torch.testing.assert_close(
            got, fused_moe_torch(x, *pair, weights, ids), atol=0.05, rtol=0.05
        )


def test_reference_loop_dequantizes_each_expert() -> None:
    """The torch loop (and the CPU dispatch) on FP8 experts is the loop on the
    dequantized experts, bit for bit."""
    x, w13, w2, weights, ids = _case(9, 8, 2, 40, 24, torch.float32, seed=4)
    x, weights, ids = x.cpu(), weights.cpu(), ids.cpu()
    w13, w2 = (Fp8Weight(w.data.cpu(), w.scale.cpu()) for w in (w13, w2))
    wide13, wide2 = (
        torch.stack([dequantize(Fp8Weight(w.data[e], w.scale[e]), torch.float32) for e in range(8)])
        for w in (w13, w2)
    )
    want = fused_moe_torch(x, wide13, wide2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), want, atol=0, rtol=0)


def test_fp8_expert_scales_must_fit() -> None:
    x, w13, w2, weights, ids = _case(3, 4, 2, 32, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, Fp8Weight(w13.data, w13.scale[:, :-1]), w2, weights, ids)


def _experts_fp8(model: nn.Module) -> list[SparseMoEBlock]:
    blocks = [m for m in model.modules() if isinstance(m, SparseMoEBlock)]
    for block in blocks:
        assert block.w13.dtype == FP8_DTYPE and block.w2.dtype == FP8_DTYPE
        assert block.w13_scale is not None and block.w13_scale.shape == block.w13.shape[:2]
        assert block.w2_scale is not None and block.w2_scale.shape == block.w2.shape[:2]
        assert type(block.gate) is nn.Linear and block.gate.weight.dtype == torch.float32
        if block.shared_expert is not None:  # a dense MLP: the dense FP8 path
            assert isinstance(block.shared_expert.gate_up_proj, Fp8Linear)
            assert isinstance(block.shared_expert.down_proj, Fp8Linear)
            assert type(block.shared_expert_gate) is nn.Linear
    return blocks


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_quantize_on_load_tracks_the_16_bit_model(family: str, tmp_path: Path) -> None:
    make, seed = MAKERS[family]
    folder = make(tmp_path / family, seed=seed)
    model, config = load_model(folder, torch.float32, "cpu", quantization="fp8")
    blocks = _experts_fp8(model)
    assert blocks
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    # Each expert quantized per row, as a dense weight is.
    sixteen, _ = load_model(folder, torch.float32, "cpu")
    first = next(m for m in sixteen.modules() if isinstance(m, SparseMoEBlock))
    codes, scale = quantize_rows(first.w2[3])
    assert torch.equal(blocks[0].w2[3].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(blocks[0].w2_scale[3], scale)
    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    ours = _last_logits(model, config, prompts)
    error = _relative_error(ours, _last_logits(sixteen, config, prompts))
    assert 0 < error < FP8_LOGITS_RTOL


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "mixtral": make_tiny_mixtral(root / "mixtral", seed=5),
        "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3_moe", seed=7),
    }


# (family, layout): Mixtral's w1/w3/w2 per tensor, Qwen's gate/up/down per channel.
CHECKPOINTS = [("mixtral", "fp8-tensor"), ("qwen3_moe", "fp8-channel-inv"), ("qwen3_moe", "ct")]
# compressed-tensors' FP8_DYNAMIC config (llm-compressor's, per channel) over the same
# tensors: its weights are `weight` codes with `weight_scale` [n, 1], as the "fp8" layout's.
_CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def _write_checkpoint(src: Path, out: Path, layout: str) -> Path:
    if layout == "fp8-tensor":
        return write_fp8_method(src, out)
    if layout == "fp8-channel-inv":
        return write_fp8_method(src, out, per_channel=True, scale_name="weight_scale_inv")
    folder = write_fp8_method(src, out, per_channel=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _CT_CONFIG
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("family", "layout"), CHECKPOINTS)
def test_fp8_expert_checkpoint_loads_as_stored(
    family: str, layout: str, moe_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = _write_checkpoint(moe_dirs[family], tmp_path / "fp8", layout)
    model, config = load_model(folder, torch.float32, "cpu")
    blocks = _experts_fp8(model)
    stored = load_file(str(folder / "model.safetensors"))
    mixtral = family == "mixtral"
    layer = max(model.moe_config.sparse_layers)
    block = model.model.layers[layer].moe
    assert block is blocks[-1]
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts.2."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    codes = torch.cat([stored[f"{prefix}{gate}.weight"], stored[f"{prefix}{up}.weight"]])
    assert torch.equal(block.w13[2].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(
        block.w2[2].view(torch.uint8), stored[f"{prefix}{down}.weight"].view(torch.uint8)
    )
    reference_dir = write_dequantized(folder, tmp_path / "dequantized")
    reference = load_file(str(reference_dir / "model.safetensors"))
    torch.testing.assert_close(
        dequantize(Fp8Weight(block.w2[2], block.w2_scale[2]), torch.float32),
        reference[f"{prefix}{down}.weight"],
        atol=0,
        rtol=0,
    )
    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    ours = _last_logits(model, config, prompts)
    assert _relative_error(ours, _reference_logits(reference_dir, prompts)) < SAME_WEIGHTS_RTOL


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), CHECKPOINTS[:2])
def test_fp8_expert_checkpoint_greedy_matches_transformers(
    family: str, layout: str, moe_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = _write_checkpoint(moe_dirs[family], tmp_path / "fp8", layout)
    engine = Engine(model_path=str(folder), debug_check_invariants=True, **ENGINE)
    try:
        _experts_fp8(engine.runner.model)
        prompts = make_prompts(engine.runner.vocab_size, LENGTHS, seed=4)
        ours = engine_outputs(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    refs = hf_greedy(write_dequantized(folder, tmp_path / "dequantized"), prompts, MAX_NEW)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref)


def test_block_wise_expert_scales_are_refused(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An expert's scale per 128 x 128 block (with no weight_block_size to refuse it by):
    refused when its scale is read, naming what is supported."""
    folder = write_fp8_method(moe_dirs["qwen3_moe"], tmp_path / "fp8", per_channel=True)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale"
    tensors[name] = torch.ones(2, 2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="block-wise scales are not supported"):
        load_model(folder, torch.float32, "cpu")


@pytest.mark.slow
def test_two_ranks_read_their_rows_of_fp8_experts(tmp_path: Path) -> None:
    """Qwen2-MoE per channel over two gloo ranks: each holds its rows of every expert's
    gate/up codes and scales, and its columns of down with down's scales whole; the
    tokens are one rank's."""
    source = make_tiny_qwen2_moe(tmp_path / "qwen2_moe", seed=6)
    folder = _write_checkpoint(source, tmp_path / "fp8", "fp8-channel-inv")
    stored = load_file(str(folder / "model.safetensors"))
    one = Engine(str(folder), **ENGINE)
    two = Engine(str(folder), tp_size=2, **ENGINE)
    try:
        block = two.runner.model.model.layers[0].moe
        _experts_fp8(two.runner.model)
        prefix = "model.layers.0.mlp.experts.1."
        up_scale = stored[f"{prefix}up_proj.weight_scale_inv"].reshape(-1)
        assert torch.equal(block.w13_scale[1, 24:], up_scale[:24])  # rank 0: rows 0-23
        assert torch.equal(block.w2_scale[1], stored[f"{prefix}down_proj.weight_scale_inv"][:, 0])
        down = stored[f"{prefix}down_proj.weight"][:, :24]
        assert torch.equal(block.w2[1].view(torch.uint8), down.view(torch.uint8))
        prompts = make_prompts(one.runner.vocab_size, [6, 29, 11], seed=9)
        params = {"max_new_tokens": 12, "temperature": 0}
        expected = one.generate(input_ids=prompts, sampling_params=params)
        got = two.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(expected, list) and isinstance(got, list)
        assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    finally:
        two.shutdown()
        one.shutdown()
