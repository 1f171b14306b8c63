"""A GGUF's quantized blocks re-packed (model_files/gguf_blocks.py) and dequantized by the
engine (kernels/block_quant.py's torch reference): bit for bit gguf's own dequantization,
for every kept type, on random blocks; a fused projection's parts widened to one layout
without changing a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from radixserve.engine.kernels.block_quant import BlockQuantWeight, dequantize_torch
from radixserve.model_files.gguf_blocks import (
    SUPPORTED_TYPES,
    Blocks,
    common_layout,
    decode,
    narrowest_scales,
)

# Where each type keeps its float16 fields in a block (the rest: codes, sub-scales).
_HALF_FIELDS = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q4_K: (0, 2),
    QType.Q6_K: (208,),
}


def random_blocks(
    qtype: QType, rows: int, k: int, seed: int = 0, scale: float = 0.01
) -> np.ndarray:
    """uint8 [rows, bytes]: random codes and sub-scales, float16 scales ~ N(0, scale)."""
    gen = np.random.default_rng(seed)
    elements, size = GGML_QUANT_SIZES[qtype]
    raw = gen.integers(0, 256, size=(rows * k // elements, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[qtype]:
        half = (gen.standard_normal(raw.shape[0]) * scale).astype(np.float16)
        raw[:, offset : offset + 2] = half.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def to_torch(blocks: Blocks) -> BlockQuantWeight:
    dtype = narrowest_scales(blocks.scales, blocks.mins)
    mins = None if blocks.mins is None else torch.from_numpy(blocks.mins.astype(dtype))
    return BlockQuantWeight(
        torch.from_numpy(blocks.codes), torch.from_numpy(blocks.scales.astype(dtype)), mins
    )


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_decode_matches_gguf_dequantize(qtype: QType) -> None:
    rows, k = 6, 512
    raw = random_blocks(qtype, rows, k)
    expected = dequantize(raw, qtype)
    blocks = decode(raw, qtype)
    assert blocks.k == k
    assert np.array_equal(blocks.dequantize(), expected)
    weight = to_torch(blocks)
    assert weight.shape == (rows, k) and weight.block == blocks.block
    assert torch.equal(dequantize_torch(weight, torch.float32), torch.from_numpy(expected))
    # A 16-bit model's weights: the float32 ones rounded once.
    wide = torch.from_numpy(expected).to(torch.bfloat16)
    assert torch.equal(dequantize_torch(weight, torch.bfloat16), wide)


def test_layouts_and_scale_dtypes() -> None:
    k = 256
    kinds = {t: decode(random_blocks(t, 2, k), t) for t in SUPPORTED_TYPES}
    assert {t: (b.bits, b.block, b.mins is not None) for t, b in kinds.items()} == {
        QType.Q8_0: (8, 32, False),
        QType.Q4_0: (4, 32, True),
        QType.Q4_1: (4, 32, True),
        QType.Q4_K: (4, 32, True),
        QType.Q6_K: (8, 16, False),
    }
    # The file's own float16 scales stay float16; the K-quants' products need float32.
    assert narrowest_scales(kinds[QType.Q4_1].scales, kinds[QType.Q4_1].mins) == np.float16
    assert narrowest_scales(kinds[QType.Q4_K].scales, kinds[QType.Q4_K].mins) == np.float32


def test_common_layout_keeps_every_weight() -> None:
    """Q4_K q/k with a Q6_K v (a Q4_K_M file): all widened to 8-bit blocks of 16 with mins."""
    parts = [
        decode(random_blocks(t, 4, 256, seed=i), t)
        for i, t in enumerate((QType.Q4_K, QType.Q4_K, QType.Q6_K))
    ]
    widened = common_layout(parts)
    assert {(b.bits, b.block, b.mins is not None) for b in widened} == {(8, 16, True)}
    for before, after in zip(parts, widened, strict=True):
        assert np.array_equal(before.dequantize(), after.dequantize())
    same = [decode(random_blocks(QType.Q4_1, 4, 64), QType.Q4_1)] * 2
    assert common_layout(same) == same


def test_unsupported_type_is_refused() -> None:
    raw = np.zeros((2, 44), dtype=np.uint8)  # two Q5_1 blocks of 32... per row of 64
    with pytest.raises(ValueError, match="Q5_1 is not kept quantized"):
        decode(raw, QType.Q5_1)
