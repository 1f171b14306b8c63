"""An FP8 KV cache's per-layer K/V scales as a checkpoint stores them (kvcache/fp8.py).

The names vLLM reads (its maybe_remap_kv_scale_name): compressed-tensors / llm-compressor
write `layers.N.self_attn.k_scale` and `.v_scale` (a `kv_cache_scheme` in the
quantization config says so); ModelOpt `self_attn.k_proj.k_scale` / `v_proj.v_scale` or
`k_proj.output_scale` / `v_proj.output_scale`; older AutoFP8 one `self_attn.kv_scale`
for both. Each is one float per layer, the dequantizing scale (stored code * scale is
the value). A layer without one gets 1.0. Only the safetensors headers and these
scalars are read.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from safetensors import safe_open

from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale
from radixserve.engine.model.weights import safetensors_files

log = logging.getLogger(__name__)

_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(?:attn|[kv]_proj)\.)?(k_scale|v_scale|kv_scale)$"
)
_OUTPUT_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_proj\.output_scale$")


def _scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") a checkpoint tensor's name gives a KV scale for, or None."""
    match = _SCALE_NAME.search(name)
    if match is not None:
        return int(match.group(1)), match.group(2).removesuffix("_scale")
    match = _OUTPUT_SCALE_NAME.search(name)
    if match is not None:
        return int(match.group(1)), match.group(2)
    return None


def checkpoint_kv_scales(folder: str | Path, num_layers: int) -> list[KVScale]:
    """Each layer's KV scales from the checkpoint in `folder`, 1.0 where it stores none.
    Raises on a scale that is not one number (per-head scales are not supported)."""
    found: dict[int, dict[str, float]] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                target = _scale_target(name)
                if target is None:
                    continue
                layer, which = target
                if layer >= num_layers:
                    raise ValueError(
                        f"KV scale {name!r} names a layer past the model's {num_layers}"
                    )
                shape = shard.get_slice(name).get_shape()
                if math.prod(shape) != 1:
                    raise ValueError(
                        f"KV scale {name!r} has shape {tuple(shape)}: only one scale per layer "
                        "(per-tensor) is supported"
                    )
                value = float(shard.get_tensor(name).reshape(()).float())
                for part in ("k", "v") if which == "kv" else (which,):
                    found.setdefault(layer, {}).setdefault(part, value)
    scales = [
        KVScale(found[i].get("k", 1.0), found[i].get("v", 1.0)) if i in found else UNIT_SCALE
        for i in range(num_layers)
    ]
    if found:
        log.info(
            "FP8 KV cache: K/V scales of %d of %d layers from the checkpoint",
            len(found),
            num_layers,
        )
    else:
        log.info("FP8 KV cache: the checkpoint stores no K/V scales; every scale is 1.0")
    return scales
