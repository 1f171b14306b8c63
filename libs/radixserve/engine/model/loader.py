"""From a model path (folder, GGUF file, or nothing) to a ready model in eval mode.

Model paths are always local: nothing here downloads.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from radixserve.engine.distributed import SINGLE, TPGroup
from radixserve.engine.model.gemma import GemmaForCausalLM
from radixserve.engine.model.llama import LlamaForCausalLM
from radixserve.engine.model.moe import MOE_ARCHITECTURES
from radixserve.engine.model.moe_models import MoEForCausalLM
from radixserve.engine.model.quantization import (
    checkpoint_block_layouts,
    checkpoint_fp8_layers,
    plan_quantization,
    quantize_projections,
    use_block_layers,
    use_fp8_layers,
)
from radixserve.model_files.config import GEMMA_ARCHITECTURES, ModelConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, config: ModelConfig
) -> torch.dtype:
    """'auto' -> the config's dtype on a GPU (bfloat16 where it names none). On the CPU:
    bfloat16 for a model whose config names bfloat16, where the CPU multiplies bfloat16
    natively (cpu_multiplies_bfloat16), else float32 (16-bit matmuls are emulated, and
    slow, elsewhere)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        named = _DTYPES.get(config.torch_dtype or "")
        if device.type == "cpu":
            native = named == torch.bfloat16 and cpu_multiplies_bfloat16()
            return torch.bfloat16 if native else torch.float32
        return named or torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@functools.cache
def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX), where
    torch's bfloat16 matmuls run about twice as fast as float32 (measured:
    lab/notebook/2026-11-28-bfloat16-where-cpu-multiplies.md)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    config: ModelConfig | None = None,
    load_format: str = "auto",
    tp: TPGroup = SINGLE,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a Hugging Face folder (model_files.paths.resolve_model_path) onto `device`, in eval mode.

    `max_positions` sizes the rotary table (default: the model's max_position_embeddings);
    `config` saves parsing config.json again when the caller already has it.
    `load_format="dummy"` draws random weights on the device instead of reading any
    (benchmarks of a model's shape: the folder needs only config.json). With `tp` of
    more than one rank, this rank's shard (model/llama.py). FP8 projections as the
    checkpoint stores them, or all of them with `quantization="fp8"` on a 16-bit one
    (model/quantization.py); a converted GGUF's projections as its blocks.
    """
    folder = Path(path)
    config = config or ModelConfig.from_pretrained(folder)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device, config)
    quant = plan_quantization(config, quantization, load_format)
    # Built on the meta device and cast there, so weights are allocated once, in their
    # final dtype, on their final device.
    model_class: type[LlamaForCausalLM] = LlamaForCausalLM
    if config.architecture in MOE_ARCHITECTURES:
        model_class = MoEForCausalLM
    elif config.architecture in GEMMA_ARCHITECTURES:
        model_class = GemmaForCausalLM
    with torch.device("meta"):
        model = model_class(config, tp)
    model = model.to(torch_dtype)
    if quant is not None and quant.read_fp8:  # after the cast, which would widen them
        use_fp8_layers(model, checkpoint_fp8_layers(folder, model._target_of))
    if quant is not None and quant.read_blocks:
        use_block_layers(model, checkpoint_block_layouts(folder, model._target_of))
    model = model.to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        # The same draws on every rank: the whole (replicated) weights must agree, or the
        # ranks' logits, and so their schedules, would part.
        init_dummy_weights(model)
    else:
        model.load_weights(folder)
    if quant is not None and quant.quantize_on_load:
        log.info("quantized %d projections to FP8", quantize_projections(model))
    model.init_rotary(max_positions)
    model.eval().requires_grad_(False)
    return model, config


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with sane scales (norms near 1, matrices ~ 1/sqrt(fan_in)), drawn on
    the weights' device: speed depends on shapes, not values."""
    gen_device = next(model.parameters()).device
    generator = torch.Generator(device=gen_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
