"""Block-wise FP8 checkpoints of a tiny Hugging Face Llama, in the two layouts people
ship, and the float32 reference holding the same weights dequantized (for the unit tests
in test_fp8_block.py and the GPU tests in tests/gpu/test_fp8_block_cuda.py).

- "fp8": `"quant_method": "fp8"` with `weight_block_size` (DeepSeek-V3, Qwen3-*-FP8):
  float8_e4m3fn weights, `weight_scale_inv` float32 [ceil(n / bn), ceil(k / bk)];
- "ct": compressed-tensors' "block" strategy (llm-compressor's FP8_BLOCK): the same
  weights, `weight_scale`, input activations dynamic per group of bk.
Weights are quantized here per block, as DeepSeek's and llm-compressor's quantizers do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve.engine.kernels.fp8 import Fp8Weight, dequantize
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE

BLOCK = (128, 128)
# The tiny Llama shaped for the blocks: q 256 rows, k and v 128 each, gate and up 384
# (whole blocks, as fused parts must be), hidden 192 (o_proj's and down_proj's last block
# of rows, and every projection's last block of k, half full).
BLOCK_SHAPE: dict[str, Any] = {
    "hidden_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

FP8_METHOD = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "float-quantized",
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "block",
                "block_structure": list(BLOCK),
                "symmetric": True,
                "dynamic": False,
                "observer": "minmax",
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "group",
                "group_size": BLOCK[1],
                "symmetric": True,
                "dynamic": True,
                "observer": None,
            },
        }
    },
}
LAYOUTS = {"fp8": (FP8_METHOD, "weight_scale_inv"), "ct": (COMPRESSED_TENSORS, "weight_scale")}


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """Each (bn, bk) block of `weight` [n, k] divided by its absmax / FP8_MAX and rounded
    to e4m3 (the last blocks may be partial)."""
    (n, k), (bn, bk) = weight.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    codes = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale, block)


def write_block_fp8(src: Path, out: Path, layout: str) -> Path:
    """`src`'s projections quantized per block, in `layout` ("fp8" or "ct")."""
    quantization, scale_name = LAYOUTS[layout]
    tensors = read_all(src)
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in _PROJECTIONS:
            fp8 = quantize_blocks(tensors[name], BLOCK)
            tensors[name] = fp8.data
            tensors[name.removesuffix("weight") + scale_name] = fp8.scale
    return _write(src, out, tensors, quantization)


def write_dequantized(fp8_dir: Path, out: Path) -> Path:
    """The block checkpoint's weights dequantized to float32, for transformers."""
    tensors = read_all(fp8_dir)
    for name in [n for n in tensors if n.endswith((".weight_scale", ".weight_scale_inv"))]:
        weight = name.rsplit(".", 1)[0] + ".weight"
        tensors[weight] = dequantize(
            Fp8Weight(tensors[weight], tensors.pop(name), BLOCK), torch.float32
        )
    return _write(fp8_dir, out, {n: t.float() for n, t in tensors.items()}, None)


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _write(
    src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict[str, Any] | None
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out
