"""FP8 checkpoints of a tiny Hugging Face model, in the two formats people ship, and the
16-bit reference that holds the same weights dequantized.

- `write_compressed_tensors`: llm-compressor's recipe (`QuantizationModifier(targets=
  "Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])`) with compressed-tensors' own
  routines: the scheme applied to the model, each weight's scale from its min/max per
  output channel (or per tensor) by `calculate_qparams`, as llm-compressor's min-max
  observer does, then ModelCompressor's float-quantized compression and config.
- `write_fp8_method`: the `"quant_method": "fp8"` layout by hand (vLLM / ModelOpt style:
  float8_e4m3fn weights, a `weight_scale` or `weight_scale_inv` per tensor or per channel);
  an MoE model's experts too (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's
  `experts.{e}.w1/w3/w2`), each apart, as FP8 Mixtral / Qwen-MoE checkpoints store them.
- `write_dequantized`: a float32 checkpoint of weights * scales, for transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX

# The files that come with a checkpoint besides its weights and config.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The checkpoint projections an FP8 recipe quantizes (Linear layers, less lm_head and
# the routers): Mixtral's experts are w1 / w3 / w2, Qwen's gate_proj / up_proj / down_proj.
_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w2",
    "w3",
)


def write_compressed_tensors(
    src: Path, out: Path, strategy: str = "channel", ignore: tuple[str, ...] = ("lm_head",)
) -> Path:
    """`src` (a Hugging Face folder) as llm-compressor writes FP8_DYNAMIC: weights FP8 per
    `strategy` ("channel" or "tensor"), activations dynamic per token; `ignore` as
    compressed-tensors matches it (names, or "re:" patterns)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    assert scheme.weights is not None
    scheme.weights.strategy = QuantizationStrategy(strategy)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=list(ignore),
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            weight = module.weight
            dims = {"channel": {"dim": 1, "keepdim": True}, "tensor": {}}[strategy]
            scale, _ = calculate_qparams(weight.amin(**dims), weight.amax(**dims), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    return out


def write_fp8_method(
    src: Path, out: Path, per_channel: bool = False, scale_name: str = "weight_scale"
) -> Path:
    """`src` as a `"quant_method": "fp8"` checkpoint: every projection's weight in
    float8_e4m3fn with its `scale_name` (a scalar per tensor, or [n, 1] per channel)."""
    tensors = _read_all(src)
    for name in list(tensors):
        if not _is_projection(name):
            continue
        weight = tensors[name].float()
        absmax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
        scale = absmax / FP8_MAX
        tensors[name] = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        tensors[name.removesuffix("weight") + scale_name] = scale.to(torch.float32)
    quantization = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "ignored_layers": ["lm_head"],
    }
    return _write(src, out, tensors, quantization)


def write_dequantized(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint's weights dequantized to float32 (data * scale, exact), its
    scales dropped, config.json without quantization_config: the same model for
    transformers."""
    tensors = _read_all(fp8_dir)
    for name in [n for n in tensors if n.endswith((".weight_scale", ".weight_scale_inv"))]:
        scale = tensors.pop(name).float()
        weight = name.rsplit(".", 1)[0] + ".weight"
        if scale.dim() == 1:
            scale = scale[:, None]
        tensors[weight] = tensors[weight].float() * scale
    tensors = {n: t.float() for n, t in tensors.items()}
    return _write(fp8_dir, out, tensors, None)


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _write(
    src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict | None
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    _copy_tokenizer(src, out)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
