"""A GGUF's quantized projections kept as they are, for the converted folder.

`--gguf-weights quantized` (gguf_convert.py): each decoder projection the file stores in
a supported type (gguf_blocks.py) is written to the folder's safetensors as its blocks,
`<module>.codes`, `<module>.block_scales` and, where the format has them,
`<module>.block_mins`, in place of a float32 `<module>.weight`; config.json names the
format (QUANTIZATION_CONFIG). Embeddings, the head, norms and biases stay float32, as in
the dequantized folder. The parts of a fused projection (q/k/v, gate/up) are written in
one layout (gguf_blocks.common_layout); a projection with a part in another type (F16,
Q5_K, ...) is written dequantized, whole. Every block tensor is checked to dequantize
to transformers' float32 tensor bit for bit (names, llama.cpp's q/k row permutation and
values), so the folder holds the file's numbers.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.model_files.gguf_blocks import Blocks

log = logging.getLogger(__name__)

CODES, SCALES, MINS = "codes", "block_scales", "block_mins"
QUANTIZATION_CONFIG = {"quant_method": "gguf", "format": "blocks", "version": 1}
# Checkpoint projections -> the fused projection they share a layout in (as the model
# fuses them: engine/model/llama.py).
_FUSED_GROUP = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}
_PROJECTIONS = (*_FUSED_GROUP, "o_proj", "down_proj")


def block_tensors(
    gguf_path: Path,
    skeleton: torch.nn.Module,
    config: Any,
    dense: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """`dense` (transformers' float32 tensors by name) with every projection the file
    keeps in a supported type replaced by its block tensors."""
    # numpy, gguf and torch here only: paths.py, which every service imports, needs
    # nothing but the names above.
    import torch
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    from radixserve.model_files.gguf_blocks import common_layout, narrowest_scales

    reader = GGUFReader(str(gguf_path))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    hf_name_of = get_gguf_hf_weights_map(skeleton, processor)
    groups: dict[str, dict[str, Blocks | None]] = defaultdict(dict)
    for tensor in reader.tensors:
        hf_name = hf_name_of.get(tensor.name, "")
        module, _, suffix = hf_name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if suffix != "weight" or leaf not in _PROJECTIONS:
            continue
        group = module.rpartition(".")[0] + "." + _FUSED_GROUP.get(leaf, leaf)
        groups[group][module] = _blocks_of(tensor, processor, dense[hf_name])
    out = dict(dense)
    kept = 0
    for group, parts in sorted(groups.items()):
        if any(blocks is None for blocks in parts.values()):
            log.warning("%s is written dequantized: a part of it is of an unsupported type", group)
            continue
        laid_out = common_layout([b for b in parts.values() if b is not None])
        for module, blocks in zip(parts, laid_out, strict=True):
            del out[module + ".weight"]
            dtype = narrowest_scales(blocks.scales, blocks.mins)
            out[f"{module}.{CODES}"] = torch.from_numpy(blocks.codes)
            out[f"{module}.{SCALES}"] = torch.from_numpy(blocks.scales.astype(dtype))
            if blocks.mins is not None:
                out[f"{module}.{MINS}"] = torch.from_numpy(blocks.mins.astype(dtype))
            kept += 1
    log.info("kept %d projections quantized", kept)
    return out


def _blocks_of(tensor: Any, processor: Any, reference: torch.Tensor) -> Blocks | None:
    """The tensor's blocks in transformers' row order, or None for an unsupported type;
    raises where they would not dequantize to transformers' tensor exactly."""
    import numpy as np

    from radixserve.model_files.gguf_blocks import SUPPORTED_TYPES, decode

    if tensor.tensor_type not in SUPPORTED_TYPES:
        return None
    # transformers' processor on the raw rows (bytes): the row permutation is the same.
    raw = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
    blocks = decode(np.ascontiguousarray(raw), tensor.tensor_type)
    if not np.array_equal(blocks.dequantize(), reference.numpy()):
        raise ValueError(
            f"{tensor.name} ({tensor.tensor_type.name}) does not re-pack exactly; convert "
            "with --gguf-weights dequantized"
        )
    return blocks
