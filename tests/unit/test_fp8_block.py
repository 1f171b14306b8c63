"""Block-wise FP8 (DeepSeek-V3, Qwen3-*-FP8, llm-compressor's FP8_BLOCK): checkpoints in
both layouts (`"quant_method": "fp8"` with weight_block_size and `weight_scale_inv`;
compressed-tensors' "block" strategy with tokens per group), written from a tiny random
Llama quantized here per [128, 128] block, read by our loader with the block scales kept
and checked against transformers' Llama on the same weights dequantized (the CPU path);
the kernel pair (triton_ops/fp8_block.py) under the Triton interpreter against float64;
what is refused, with why (the checkpoints: fp8_block_checkpoints.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from radixserve.engine.kernels import linear as linear_ops
from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize, quantize_token_groups
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from radixserve.engine.model.loader import load_model
from radixserve.engine.model.quantization import PROJECTIONS, Fp8Linear
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import make_prompts
from tests.unit.fp8_block_checkpoints import (
    BLOCK,
    BLOCK_SHAPE,
    COMPRESSED_TENSORS,
    FP8_METHOD,
    LAYOUTS,
    quantize_blocks,
    read_all,
    write_block_fp8,
    write_dequantized,
)
from tests.unit.test_fp8_model import SAME_WEIGHTS_RTOL, _last_logits, _reference_logits

LENGTHS = [5, 23, 1, 17]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=5, **BLOCK_SHAPE)


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("block_fp8")
    return {layout: write_block_fp8(tiny_dir, root / layout, layout) for layout in LAYOUTS}


def test_the_layouts_are_what_transformers_and_compressed_tensors_read() -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.utils.quantization_config import FineGrainedFP8Config

    fp8 = FineGrainedFP8Config.from_dict(FP8_METHOD)
    assert tuple(fp8.weight_block_size) == BLOCK and fp8.activation_scheme == "dynamic"
    ct = QuantizationConfig.model_validate(COMPRESSED_TENSORS)
    scheme = ct.config_groups["group_0"]
    assert scheme.weights is not None and scheme.input_activations is not None
    assert list(scheme.weights.block_structure or []) == list(BLOCK)
    assert scheme.input_activations.group_size == BLOCK[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_checkpoint_loads_as_stored(
    layout: str, block_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Every projection FP8 with its block scales as stored (fused parts' stacked), and
    the logits of transformers' Llama over the dequantized weights."""
    folder = block_dirs[layout]
    model, config = load_model(folder, torch.float32, "cpu")
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            assert isinstance(module, Fp8Linear) and module.block == BLOCK, name
    assert type(model.lm_head) is nn.Linear
    stored = read_all(folder)
    scale_name = LAYOUTS[layout][1]
    attention = model.model.layers[1].self_attn
    scales = [stored[f"model.layers.1.self_attn.{p}_proj.{scale_name}"] for p in "qkv"]
    qkv = attention.qkv_proj.fp8_weight()
    assert qkv.block == BLOCK and torch.equal(qkv.scale, torch.cat(scales))
    o_proj = attention.o_proj.fp8_weight()  # 192 rows: a block and a half
    assert torch.equal(o_proj.scale, stored[f"model.layers.1.self_attn.o_proj.{scale_name}"])
    codes = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.data.view(torch.uint8), codes.view(torch.uint8))

    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    ours = _last_logits(model, config, prompts)
    reference = _reference_logits(write_dequantized(folder, tmp_path / "dequantized"), prompts)
    assert float((ours - reference).norm() / reference.norm()) < SAME_WEIGHTS_RTOL


def test_the_cpu_projections_multiply_the_dequantized_weight() -> None:
    """kernels/linear's seam on the CPU: linear and add_norm_linear (gated) over a block
    weight equal the torch ops over its dequantized form."""
    gen = torch.Generator().manual_seed(0)
    weight = quantize_blocks(torch.randn(256, 200, generator=gen), BLOCK)
    wide = dequantize(weight, torch.float32)
    x, bias = torch.randn(3, 200, generator=gen), torch.randn(256, generator=gen)
    assert torch.equal(linear_ops.linear(x, weight, bias), F.linear(x, wide, bias))
    norm = torch.ones(200)
    act, summed = linear_ops.add_norm_linear(x, None, norm, 1e-5, weight, None, gated=True)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = F.linear(normed, wide).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up)
    assert summed is x


def _with(src: Path, dst: Path, quantization: dict[str, Any]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _ct_with(weights: dict[str, Any], acts: dict[str, Any]) -> dict[str, Any]:
    group = COMPRESSED_TENSORS["config_groups"]["group_0"]
    merged = {
        **group,
        "weights": {**group["weights"], **weights},
        "input_activations": {**group["input_activations"], **acts},
    }
    return {**COMPRESSED_TENSORS, "config_groups": {"group_0": merged}}


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({**FP8_METHOD, "weight_block_size": [128, 96]}, "blocks \\[128, 96\\]"),
        ({**FP8_METHOD, "weight_block_size": [8, 8]}, "blocks \\[8, 8\\]"),
        ({**FP8_METHOD, "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({**FP8_METHOD, "fmt": "e5m2"}, "fmt 'e5m2'"),
        (_ct_with({}, {"group_size": 64}), "per group of 64"),
        (_ct_with({}, {"dynamic": False}), "group 'group_0'"),
        (_ct_with({"block_structure": [64, 64]}, {"group_size": 64}), None),
    ],
)
def test_unsupported_block_schemes_are_refused(
    tiny_dir: Path, tmp_path: Path, quantization: dict[str, Any], message: str | None
) -> None:
    """Refused at start-up naming what is supported; the last is supported (blocks of
    64 fit the model), and its 16-bit weights stay 16-bit."""
    folder = _with(tiny_dir, tmp_path / "model", quantization)
    if message is None:
        model, _ = load_model(folder, torch.float32, "cpu")
        assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
        return
    with pytest.raises(ValueError, match=message) as info:
        load_model(folder, torch.float32, "cpu")
    assert "block-wise FP8" in str(info.value)


def test_fused_parts_must_be_whole_blocks(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _with(tiny_dir, tmp_path / "model", {**FP8_METHOD, "weight_block_size": [256, 128]})
    with pytest.raises(ValueError, match="k_proj / v_proj has 128 rows, not whole blocks of 256"):
        load_model(folder, torch.float32, "cpu")


def test_a_scale_not_of_the_blocks_shape_is_refused(
    block_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = shutil.copytree(block_dirs["fp8"], tmp_path / "model")
    tensors = read_all(folder)
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()  # one scale per block row
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"down_proj.weight \[192, 384\] has a weight scale of shape \[2, 1\]"
    ):
        load_model(folder, torch.float32, "cpu")


# The kernel pair under the interpreter (compiled on CUDA: tests/gpu/test_fp8_block_cuda.py).
KERNEL_SHAPES = [(1, 256, 384), (5, 256, 384), (33, 256, 384), (7, 200, 320)]


def _kernel_device() -> torch.device:
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.helpers.triton_interpreter import kernel_test_device

    return kernel_test_device()


def test_group_quantization_kernel() -> None:
    """Scales bit for bit and codes equal torch's, on tokens whose groups scale to exact
    codes (the interpreter's float32 -> e4m3 cast rounds unlike the GPU's; the GPU test
    compares rounded codes)."""
    device = _kernel_device()
    from radixserve.engine.kernels.triton_ops.fp8_block import quantize_token_groups_triton

    gen = torch.Generator().manual_seed(1)
    m, k = 9, 320
    codes = torch.randn(m, k, generator=gen).mul(100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codes[:, ::128] = torch.tensor(FP8_MAX).to(FP8_DTYPE)  # each group's absmax a full code
    codes[3, 128:256] = 0.0  # an all-zero group: MIN_SCALE
    x = (codes.float() * torch.logspace(-4, 4, m)[:, None]).to(device)
    ours_codes, ours_scale = quantize_token_groups_triton(x, 128)
    ref_codes, ref_scale = quantize_token_groups(x.cpu(), 128)
    assert ours_scale.shape == (m, 3) and torch.equal(ours_scale.cpu(), ref_scale)
    assert ref_scale[3, 1] == MIN_SCALE
    assert torch.equal(ours_codes.cpu().view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize(("m", "n", "k"), KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matmul_kernel(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """The block-scaled W8A8 GEMM against float64 over the dequantized tokens and
    weight; blocks of unlike scales (a scale on the wrong block shows), bias on one."""
    device = _kernel_device()
    from radixserve.engine.kernels.triton_ops.fp8_block import (
        block_matmul_fp8_triton,
        quantize_token_groups_triton,
    )

    gen = torch.Generator().manual_seed(m)
    wide = torch.randn(n, k, generator=gen) * torch.logspace(-1, 1, n)[:, None]
    wide *= torch.logspace(1, -1, k)[None, :]
    weight = quantize_blocks(wide, BLOCK)
    weight = Fp8Weight(weight.data.to(device), weight.scale.to(device), BLOCK)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if m == 5 else None
    codes, scale = quantize_token_groups_triton(x, BLOCK[1])
    out = block_matmul_fp8_triton(codes, scale, weight.data, weight.scale, BLOCK, bias, dtype)
    tokens = codes.double() * scale.double().repeat_interleave(BLOCK[1], 1)[:, :k]
    ref = tokens @ dequantize(weight, torch.float64).T
    if bias is not None:
        ref += bias.double()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    scale_out = float(ref.abs().max())
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=rtol, atol=rtol * scale_out)
