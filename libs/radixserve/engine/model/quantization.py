"""Which of a model's projections hold FP8 weights, and how they get there.

A projection is an `nn.Linear` (16-bit weight) or an `Fp8Linear` (float8_e4m3fn weight
and a float32 scale per output row, or per block); the decoder passes `weight_of(layer)` to the
kernels (kernels/linear.py), which choose theirs from it (kernels/fp8.py). Only the
decoder's projections (PROJECTIONS: qkv, o, gate_up, down; a shared expert's too) and a
sparse MoE block's stacked experts (EXPERT_WEIGHTS: w13, w2, codes [experts, rows, k]
with a float32 `<name>_scale` [experts, rows] beside them; `expert_weight` gives
kernels/moe.py a stacked Fp8Weight) may be FP8: embeddings, the head, norms and router
gates stay in the model's dtype, as llm-compressor leaves them by default.

FP8 projections come from
- an FP8 checkpoint, in either format people ship: llm-compressor's compressed-tensors
  ('float-quantized': `*.weight` in float8_e4m3fn, `*.weight_scale` per channel [n, 1]
  or per tensor) or `"quant_method": "fp8"` (vLLM / ModelOpt style: `weight_scale` or
  `weight_scale_inv`, per tensor or per channel). The layers the checkpoint stores in
  FP8 (what its safetensors headers say) are built as Fp8Linear before loading, so an
  ignore list is honoured as the checkpoint applied it; the rest stay 16-bit. Static
  input scales are not read: activations are quantized per token as they come, which
  is at least as fine as a per-tensor scale;
- a block-wise FP8 checkpoint (DeepSeek-V3, Qwen3-*-FP8: `"weight_block_size": [bn, bk]`
  with `weight_scale_inv` [ceil(n / bn), ceil(k / bk)]; compressed-tensors' "block"
  strategy with `block_structure`, tokens per group of bk): the projections hold their
  block scales (Fp8Weight with a block), activations quantized per token per group of
  bk; dense projections only (block-wise experts are refused);
- `--quantization fp8` on a 16-bit checkpoint (or random weights, load_format dummy):
  every projection, and every expert, quantized per output row after loading.

A GGUF converted with its blocks kept (model_files/gguf_quantized.py: quantization_config
`{"quant_method": "gguf"}`) gives BlockQuantLinear projections instead: 4- or 8-bit codes
with per-block scales and mins (kernels/block_quant.py), the layout of each read from the
safetensors headers, as FP8 layers are.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from radixserve.engine.kernels.block_quant import BlockQuantWeight
from radixserve.engine.kernels.fp8 import Fp8Weight, quantize_rows, quantize_weight
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.model.weights import StoredTensor, safetensors_files
from radixserve.model_files.config import ModelConfig
from radixserve.model_files.gguf_quantized import CODES, MINS, SCALES

log = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)  # --quantization's values (unset: as the checkpoint is)
# The decoder's projections that may hold FP8 weights (leaf module names).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# A sparse MoE block's stacked expert weights (model/moe.py); FP8, each has its row
# scales in the parameter named with EXPERT_SCALE appended (None while 16-bit).
EXPERT_WEIGHTS = ("w13", "w2")
EXPERT_SCALE = "_scale"
WEIGHT_SCALE = "weight_scale"
SUPPORTED = (
    "supported: FP8 checkpoints from compressed-tensors (format 'float-quantized': 8-bit "
    "float weights with per-channel or per-tensor scales) or with quant_method 'fp8' "
    "(per-tensor or per-channel weight_scale / weight_scale_inv), for dense and MoE "
    "models (experts included); block-wise FP8 (weight_block_size, or compressed-tensors "
    "strategy 'block' with dynamic per-group activations) for dense models, blocks "
    "[bn, bk] of powers of two from 16 to 256 that divide each fused part (q, k, v; gate, "
    "up) into whole blocks; and --quantization fp8 on a 16-bit checkpoint"
)
# Block-wise FP8's block sides: powers of two (the GEMM's k tile is one block) in range.
BLOCK_SIDES = (16, 256)
# Checkpoint tensors the weights' loader does not read: static activation scales, and
# FP8 KV cache scales (model/kv_scales.py reads those, for --kv-cache-dtype fp8_e4m3).
_UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_SAFETENSORS_FP8 = "F8_E4M3"


@dataclass(frozen=True)
class QuantizationPlan:
    """How a model gets its FP8 projections: read from the checkpoint as they are stored
    (`read_fp8`), or quantized from the 16-bit ones after loading (`quantize_on_load`);
    or its block-quantized ones, read as a converted GGUF stores them (`read_blocks`)."""

    read_fp8: bool
    quantize_on_load: bool
    read_blocks: bool = False


def plan_quantization(
    config: ModelConfig, requested: str | None, load_format: str = "auto"
) -> QuantizationPlan | None:
    """The plan for a checkpoint (its config's quantization_config) and --quantization;
    None for a 16-bit model left as it is. Unsupported schemes raise ValueError."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {requested!r}")
    stored = config.raw.get("quantization_config") or config.raw.get("compression_config")
    if stored is None:
        return None if requested is None else QuantizationPlan(False, True)
    if stored.get("quant_method") == "gguf":
        if requested is not None:
            raise ValueError(
                f"--quantization {requested} takes a 16-bit checkpoint; this is a GGUF's "
                "blocks (convert it with --gguf-weights dequantized to quantize it so)"
            )
        return None if load_format == "dummy" else QuantizationPlan(False, False, True)
    check_checkpoint_scheme(stored)
    block = weight_block(stored)
    if block is not None and load_format != "dummy":
        _check_block_fits(config, block)
    if requested is not None:
        log.info("the checkpoint is FP8 already: --quantization %s reads it as it is", requested)
    if load_format == "dummy":  # random weights of the checkpoint's shapes
        return QuantizationPlan(False, True)
    return QuantizationPlan(True, False)


def check_checkpoint_scheme(stored: dict[str, Any]) -> None:
    """Refuse, naming what is supported, any scheme but FP8 weights with per-channel,
    per-tensor or block scales."""
    method = stored.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(stored)
    elif method == "fp8":
        fmt = stored.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt {fmt!r} is not supported (e4m3 only); {SUPPORTED}")
        scheme = stored.get("activation_scheme", "dynamic")
        allowed = ("dynamic",) if stored.get("weight_block_size") else ("dynamic", "static")
        if scheme not in allowed:
            raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported; {SUPPORTED}")
    else:
        raise ValueError(f"quantization method {method!r} is not supported; {SUPPORTED}")
    weight_block(stored)  # its block shape checked


def weight_block(stored: dict[str, Any]) -> tuple[int, int] | None:
    """A block-wise FP8 checkpoint's block (rows, columns), from its quantization_config
    ('fp8': weight_block_size; compressed-tensors: its groups' block_structure); None for
    per-channel or per-tensor scales. Raises for a block shape the kernels do not take."""
    if stored.get("quant_method") == "fp8":
        found = [stored["weight_block_size"]] if stored.get("weight_block_size") else []
    else:
        groups = (stored.get("config_groups") or {}).values()
        found = [
            (g.get("weights") or {}).get("block_structure")
            for g in groups
            if (g.get("weights") or {}).get("strategy") == "block"
        ]
        if found and len(found) != len(groups):
            raise ValueError(f"compressed-tensors groups mix block and other scales; {SUPPORTED}")
    if not found:
        return None
    low, high = BLOCK_SIDES
    for block in found:
        ok = isinstance(block, list | tuple) and len(block) == 2
        if not ok or not all(
            isinstance(b, int) and low <= b <= high and not b & (b - 1) for b in block
        ):
            raise ValueError(f"block-wise FP8 with blocks {block!r} is not supported; {SUPPORTED}")
    if any(list(b) != list(found[0]) for b in found):
        raise ValueError(f"block-wise FP8 with blocks {found} (one per group): {SUPPORTED}")
    return int(found[0][0]), int(found[0][1])


def _config_block(config: ModelConfig) -> tuple[int, int] | None:
    stored = config.raw.get("quantization_config") or config.raw.get("compression_config")
    return None if stored is None else weight_block(stored)


def _check_block_fits(config: ModelConfig, block: tuple[int, int]) -> None:
    """Each part of a fused projection must be whole blocks of rows: the fused scale is
    the parts' block rows stacked (an unfused projection's last block may be partial)."""
    c = config
    parts = {
        "q_proj": c.num_attention_heads * c.head_dim,
        "k_proj / v_proj": c.num_key_value_heads * c.head_dim,
        "gate_proj / up_proj": c.intermediate_size,
    }
    for name, rows in parts.items():
        if rows % block[0]:
            raise ValueError(
                f"block-wise FP8 with blocks {list(block)}: {name} has {rows} rows, not whole "
                f"blocks of {block[0]}; {SUPPORTED}"
            )


def _check_compressed_tensors(stored: dict[str, Any]) -> None:
    for key in ("sparsity_config", "transform_config"):
        if stored.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported; {SUPPORTED}")
    groups = stored.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors config names no config_groups; {SUPPORTED}")
    for name, group in groups.items():
        form = group.get("format") or stored.get("format")
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        blocks = weights.get("strategy") == "block"
        fp8_weights = (
            weights.get("num_bits") == 8
            and weights.get("type") == "float"
            and weights.get("strategy") in ("channel", "tensor", "block")
            and weights.get("symmetric", True)
            and not weights.get("dynamic", False)
        )
        fp8_acts = acts is None or (acts.get("num_bits") == 8 and acts.get("type") == "float")
        if blocks and acts is not None:  # tokens per group of the block's columns, as they come
            block_k = (weights.get("block_structure") or [None, None])[-1]
            fp8_acts = fp8_acts and (
                acts.get("dynamic") is True
                and acts.get("strategy") == "group"
                and acts.get("group_size") == block_k
            )
        if form != "float-quantized" or not fp8_weights or not fp8_acts:
            raise ValueError(
                f"compressed-tensors group {name!r} (format {form!r}, weights "
                f"{_scheme_text(weights)}, input activations {_scheme_text(acts)}) is not "
                f"supported; {SUPPORTED}"
            )
        if group.get("output_activations"):
            raise ValueError(f"quantized output activations are not supported; {SUPPORTED}")
    if stored.get("kv_cache_scheme"):
        log.info("the checkpoint has FP8 KV cache scales: used with --kv-cache-dtype fp8_e4m3 only")


def _scheme_text(args: dict[str, Any] | None) -> str:
    if not args:
        return "none"
    text = f"{args.get('num_bits')}-bit {args.get('type')} per {args.get('strategy')}"
    if args.get("strategy") == "block":
        return f"{text} {args.get('block_structure')}"
    if args.get("strategy") == "group":
        return f"{text} of {args.get('group_size')}"
    return text


class Fp8Linear(nn.Module):
    """A projection with an FP8 weight: `weight` [out, in] float8_e4m3fn, `weight_scale`
    [out] float32 (row i is weight[i] * weight_scale[i]), `bias` in the model's dtype.

    Block-wise (`block` (bn, bk)): `weight_scale` is [out, ceil(in / bk)], each block's
    scale on each of its bn rows, and `fp8_weight` hands the kernels every bn-th row: the
    block scales. NOTE: rows, not blocks, because model/llama.py's loader places a fused
    part's scale by its weight rows."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        data = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        scale_shape = (
            (out_features,) if block is None else (out_features, -(-in_features // block[1]))
        )
        scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(data, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = bias if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantized(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized per output row (its bias kept)."""
        fp8 = quantize_weight(linear.weight.detach())
        layer = cls(linear.in_features, linear.out_features, linear.bias, device="meta")
        layer.weight = nn.Parameter(fp8.data, requires_grad=False)
        layer.weight_scale = nn.Parameter(fp8.scale, requires_grad=False)
        return layer

    def fp8_weight(self) -> Fp8Weight:
        if self.block is None:
            return Fp8Weight(self.weight, self.weight_scale)
        return Fp8Weight(self.weight, self.weight_scale[:: self.block[0]], self.block)

    def extra_repr(self) -> str:
        blocks = "" if self.block is None else f" blocks of {list(self.block)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8{blocks}"


@dataclass(frozen=True)
class BlockLayout:
    """How a projection's blocks are stored (the same for every part of a fused one)."""

    codes_dtype: torch.dtype  # uint8: 4-bit, two a byte; int8: 8-bit
    block: int
    scales_dtype: torch.dtype
    has_mins: bool


class BlockQuantLinear(nn.Module):
    """A projection with a block-quantized weight (kernels/block_quant.py): `codes`,
    `block_scales` and, with mins, `block_mins`; `bias` in the model's dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layout: BlockLayout,
        bias: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features % layout.block:
            raise ValueError(f"rows of {in_features} are not blocks of {layout.block}")
        self.in_features = in_features
        self.out_features = out_features
        width = in_features // 2 if layout.codes_dtype == torch.uint8 else in_features
        blocks = (out_features, in_features // layout.block)

        def frozen(shape: tuple[int, int], dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False)

        self.codes = frozen((out_features, width), layout.codes_dtype)
        self.block_scales = frozen(blocks, layout.scales_dtype)
        self.block_mins = frozen(blocks, layout.scales_dtype) if layout.has_mins else None
        self.bias = bias if bias is None else nn.Parameter(bias, requires_grad=False)

    def block_weight(self) -> BlockQuantWeight:
        return BlockQuantWeight(self.codes, self.block_scales, self.block_mins)

    def extra_repr(self) -> str:
        weight = self.block_weight()
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{weight.bits}-bit blocks of {weight.block}"
        )


def expert_weight(block: nn.Module, leaf: str) -> torch.Tensor | Fp8Weight:
    """What kernels/moe.fused_moe takes for a block's stacked expert weight `leaf` (one
    of EXPERT_WEIGHTS): the 16-bit tensor, or its codes with their row scales."""
    weight = getattr(block, leaf)
    scale = getattr(block, leaf + EXPERT_SCALE)
    return weight if scale is None else Fp8Weight(weight, scale)


def expert_weight_names(model: nn.Module) -> list[str]:
    """The model's 16-bit stacked expert weights (`<block>.w13`, `<block>.w2`)."""
    return [
        f"{name}.{leaf}"
        for name, module in model.named_modules()
        for leaf in EXPERT_WEIGHTS
        if hasattr(module, leaf + EXPERT_SCALE) and getattr(module, leaf + EXPERT_SCALE) is None
    ]


def _set_expert_weight(block: nn.Module, leaf: str, weight: Fp8Weight) -> None:
    setattr(block, leaf, nn.Parameter(weight.data, requires_grad=False))
    setattr(block, leaf + EXPERT_SCALE, nn.Parameter(weight.scale, requires_grad=False))


def weight_of(
    layer: nn.Linear | Fp8Linear | BlockQuantLinear,
) -> torch.Tensor | Fp8Weight | BlockQuantWeight:
    """What the kernels take for a projection: its 16-bit weight, its FP8 one or its
    blocks."""
    if isinstance(layer, Fp8Linear):
        return layer.fp8_weight()
    if isinstance(layer, BlockQuantLinear):
        return layer.block_weight()
    return layer.weight


_SAFETENSORS_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F16": torch.float16,
    "F32": torch.float32,
}


def checkpoint_block_layouts(
    folder: str | Path, target_of: Callable[[str], tuple[str, int]]
) -> dict[str, BlockLayout]:
    """The model's projections the checkpoint stores as blocks, with their layouts, from
    the safetensors headers (nothing read); `target_of` as for checkpoint_fp8_layers.
    Raises where the parts of a fused projection differ (the converter writes them
    alike)."""
    found: dict[str, dict[str, tuple[str, list[int]]]] = defaultdict(dict)
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                stored = shard.get_slice(name)
                found[name.rpartition(".")[0]][name.rpartition(".")[2]] = (
                    stored.get_dtype(),
                    stored.get_shape(),
                )
    layouts: dict[str, BlockLayout] = {}
    for module, tensors in found.items():
        if CODES not in tensors:
            continue
        (codes_dtype, codes_shape), (scales_dtype, scales_shape) = tensors[CODES], tensors[SCALES]
        k = codes_shape[1] * (2 if codes_dtype == "U8" else 1)
        layout = BlockLayout(
            _SAFETENSORS_DTYPES[codes_dtype],
            k // scales_shape[1],
            _SAFETENSORS_DTYPES[scales_dtype],
            MINS in tensors,
        )
        target = target_of(f"{module}.{CODES}")[0].removesuffix(f".{CODES}")
        if layouts.setdefault(target, layout) != layout:
            raise ValueError(f"the parts of {target} are stored in different block layouts")
    return layouts


def use_block_layers(model: nn.Module, layouts: dict[str, BlockLayout]) -> None:
    """Swap each named nn.Linear (on the meta device, before loading) for a
    BlockQuantLinear of its shape and the layout; biases stay in their dtype."""
    for name, layout in sorted(layouts.items()):
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            raise ValueError(f"{name} is stored as blocks; only projections may be")
        parent, leaf = _parent_of(model, name)
        linear = getattr(parent, leaf)
        bias = None if linear.bias is None else torch.empty_like(linear.bias, device="meta")
        blocks = BlockQuantLinear(
            linear.in_features, linear.out_features, layout, bias, device="meta"
        )
        setattr(parent, leaf, blocks)


def projection_names(model: nn.Module) -> list[str]:
    """The model's 16-bit projections that may hold FP8 weights."""
    return [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in PROJECTIONS and type(module) is nn.Linear
    ]


def use_fp8_layers(model: nn.Module, names: list[str] | set[str]) -> None:
    """Swap each named nn.Linear (on the meta device, before loading) for an Fp8Linear of
    its shape, biases kept in their dtype, with the blocks the model's config names
    (block-wise FP8); each named stacked expert weight for codes and row scales of its
    shape."""
    block = _config_block(cast(ModelConfig, model.config))
    for name in sorted(names):
        parent, leaf = _parent_of(model, name)
        if leaf in EXPERT_WEIGHTS:
            shape = getattr(parent, leaf).shape
            codes = torch.empty(shape, dtype=FP8_DTYPE, device="meta")
            scale = torch.empty(shape[:2], dtype=torch.float32, device="meta")
            _set_expert_weight(parent, leaf, Fp8Weight(codes, scale))
            continue
        linear = getattr(parent, leaf)
        bias = None if linear.bias is None else torch.empty_like(linear.bias, device="meta")
        fp8 = Fp8Linear(linear.in_features, linear.out_features, bias, "meta", block)
        setattr(parent, leaf, fp8)


@torch.no_grad()
def quantize_projections(model: nn.Module) -> int:
    """Quantize every 16-bit projection and stacked expert weight per output row (after
    loading); the count done."""
    names = projection_names(model)
    for name in names:
        parent, leaf = _parent_of(model, name)
        setattr(parent, leaf, Fp8Linear.quantized(getattr(parent, leaf)))
    experts = expert_weight_names(model)
    for name in experts:
        parent, leaf = _parent_of(model, name)
        stacked = getattr(parent, leaf).detach()
        codes = torch.empty(stacked.shape, dtype=FP8_DTYPE, device=stacked.device)
        scale = torch.empty(stacked.shape[:2], dtype=torch.float32, device=stacked.device)
        for e in range(stacked.shape[0]):  # one expert at a time: a float32 copy of one
            codes[e], scale[e] = quantize_rows(stacked[e])
        _set_expert_weight(parent, leaf, Fp8Weight(codes, scale))
    return len(names) + len(experts)


def _parent_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return model.get_submodule(parent), leaf


def checkpoint_fp8_layers(
    folder: str | Path, target_of: Callable[[str], tuple[str, int]]
) -> set[str]:
    """The model's projections that the checkpoint stores in FP8, from the safetensors
    headers (nothing read); `target_of` maps a checkpoint name to the model's parameter
    (the model's `_target_of`). Raises where FP8 tensors cannot be served as stored: an
    FP8 tensor outside the projections and experts, or one part of a fused projection
    (q/k/v, gate/up, a block's stacked experts) in FP8 and another not (an ignore list
    naming one of them); block-wise, an FP8 weight whose scale is not one per block of
    the config's shape, or FP8 experts (not served block-wise yet)."""
    block = _config_block(ModelConfig.from_pretrained(folder))
    parts: dict[str, dict[str, bool]] = defaultdict(dict)
    shapes: dict[str, list[int]] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name.endswith((".weight_scale", ".weight_scale_inv")):
                    shapes[name] = shard.get_slice(name).get_shape()
                if not name.endswith(".weight"):
                    continue
                stored = shard.get_slice(name)
                dtype = stored.get_dtype()
                if dtype.startswith("F8_") and dtype != _SAFETENSORS_FP8:
                    raise ValueError(f"{name} is {dtype}; only float8_e4m3fn FP8 is {SUPPORTED}")
                if dtype == _SAFETENSORS_FP8:
                    shapes[name] = stored.get_shape()
                target, _ = target_of(name)
                parts[target.removesuffix(".weight")][name] = dtype == _SAFETENSORS_FP8
    if block is not None:
        _check_block_scales(shapes, block)
    layers: set[str] = set()
    for module, stored in parts.items():
        if not any(stored.values()):
            continue
        if module.rsplit(".", 1)[-1] not in PROJECTIONS + EXPERT_WEIGHTS:
            fp8_names = ", ".join(sorted(n for n, fp8 in stored.items() if fp8)[:4])
            raise ValueError(
                f"{fp8_names} is stored in FP8: radixserve serves FP8 in the decoder's q/k/v, o, "
                "gate/up and down projections and MoE experts only (embeddings, lm_head, "
                f"norms and router gates stay 16-bit); {SUPPORTED}"
            )
        if not all(stored.values()):
            fp8, wide = (
                sorted(n for n, f in stored.items() if f is want) for want in (True, False)
            )
            raise ValueError(
                f"the checkpoint stores {', '.join(fp8)} in FP8 but {', '.join(wide)} in 16 "
                "bits: radixserve fuses them into one projection, so an ignore list must "
                "name all of them or none"
            )
        if block is not None and module.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            raise ValueError(
                f"{module} (MoE experts) is stored block-wise: block-wise FP8 is served for "
                f"dense projections only so far; {SUPPORTED}"
            )
        layers.add(module)
    return layers


def _check_block_scales(shapes: dict[str, list[int]], block: tuple[int, int]) -> None:
    """Each FP8 weight [n, k] has a scale [ceil(n / bn), ceil(k / bk)] beside it."""
    (bn, bk), scales = (
        block,
        {n.removesuffix("_inv"): s for n, s in shapes.items() if "_scale" in n},
    )
    for name, (n, k) in ((n, s) for n, s in shapes.items() if n.endswith(".weight")):
        expected = [-(-n // bn), -(-k // bk)]
        scale = scales.get(name.removesuffix("weight") + WEIGHT_SCALE)
        if scale != expected:
            raise ValueError(
                f"{name} [{n}, {k}] has a weight scale of shape {scale}; block-wise FP8 with "
                f"blocks {list(block)} takes {expected}"
            )


def checkpoint_name(name: str) -> str | None:
    """The name a checkpoint tensor loads under (`weight_scale_inv`, the 'fp8' format's
    spelling, is our `weight_scale`), or None for tensors a dynamic FP8 model does not
    read (static input scales, KV cache scales)."""
    if name.endswith(_UNUSED_SUFFIXES):
        return None
    if name.endswith(".weight_scale_inv"):
        return name.removesuffix("_inv")
    return name


def copy_weight_scale(dest: torch.Tensor, stored: StoredTensor, rank: int, ranks: int) -> None:
    """Copy an FP8 projection's checkpoint scale into `dest` (float32, one per output row):
    rows [rank * len(dest), (rank + 1) * len(dest)) of a per-channel scale of
    ranks * len(dest) rows ([n] or [n, 1]); a per-tensor scale ([] or [1]) broadcast.
    A block-wise layer's `dest` [rows, k blocks] (Fp8Linear) takes those rows' blocks."""
    rows = dest.shape[0]
    shape = stored.shape
    if dest.dim() == 2:
        _copy_block_scale(dest, stored, rank, ranks)
        return
    if math.prod(shape) == 1:
        dest.fill_(stored.read().reshape(()).float())
        return
    if shape not in ((rows * ranks,), (rows * ranks, 1)):
        raise ValueError(
            f"weight scale {stored.name!r} has shape {shape}; expected one per output row "
            f"({rows * ranks}) or one for the tensor (block-wise scales are not supported)"
        )
    dest.copy_(stored.read_range(0, rank * rows, rows).reshape(rows))


def _copy_block_scale(dest: torch.Tensor, stored: StoredTensor, rank: int, ranks: int) -> None:
    """Rows [rank * len(dest), (rank + 1) * len(dest)) of a block scale [ceil(n / bn),
    k blocks], each block row repeated over its bn rows (bn from the shapes: the power of
    two that makes ceil(n / bn) block rows; checkpoint_fp8_layers checked the config's)."""
    (rows, k_blocks), shape = dest.shape, stored.shape
    full = rows * ranks
    sides = [1 << i for i in range(32) if len(shape) == 2 and -(-full // (1 << i)) == shape[0]]
    if len(shape) != 2 or shape[1] != k_blocks or not sides:
        raise ValueError(
            f"weight scale {stored.name!r} has shape {shape}; expected block scales of "
            f"{k_blocks} columns for {full} rows (a rank's columns of block scales, under "
            "tensor parallelism, are not read yet)"
        )
    block_rows = sides[0]  # one block row (n <= bn): every side >= n reads the same
    if ranks > 1 and rows % block_rows:
        raise ValueError(
            f"weight scale {stored.name!r}: a rank's {rows} rows are not whole blocks of "
            f"{block_rows} (tensor parallelism splits each part into whole blocks)"
        )
    first, count = rank * rows // block_rows, -(-rows // block_rows)
    blocks = stored.read_range(0, first, count).float()
    dest.copy_(blocks.repeat_interleave(block_rows, 0)[:rows])
