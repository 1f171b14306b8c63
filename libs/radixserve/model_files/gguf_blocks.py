"""A GGUF tensor's quantized blocks as codes, per-block scales and mins (numpy, no torch).

Every supported type becomes one of two layouts, so the kernels handle two cases only
(engine/kernels/block_quant.py):
- 4-bit: `codes` uint8 [n, k / 2], element 2j of a row in the low nibble of byte j and
  2j + 1 in the high one, unsigned (0..15); w = scale * q + min, per block of 32.
  Q4_0 (min = -8 * scale), Q4_1, and Q4_K, whose 256-element super-blocks are re-packed
  into their eight blocks of 32 with scale d * sc and min -dmin * m;
- 8-bit: `codes` int8 [n, k]; w = scale * q (+ min). Q8_0 (blocks of 32) and Q6_K
  (q - 32, blocks of 16, scale d * sc).
Every scale and min is a product of the file's float16 scale and at most an 8-bit
integer, exact in float32, and each weight scale * q (+ min) rounds once, as gguf's own
dequantization does: the weights are the file's numbers, bit for bit (gguf_convert.py
checks this against transformers' dequantized tensors on every conversion).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import Q4_K

SUPPORTED_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K)
_SUPER = 256  # elements of a K-quant super-block


@dataclass(frozen=True)
class Blocks:
    """One weight [rows, k] as codes and per-block scales (and mins)."""

    codes: np.ndarray  # uint8 [rows, k / 2] (4-bit) or int8 [rows, k] (8-bit)
    scales: np.ndarray  # float32 [rows, k / block]
    mins: np.ndarray | None  # like scales; None: no offset
    block: int

    @property
    def bits(self) -> int:
        return 8 if self.codes.dtype == np.int8 else 4

    @property
    def k(self) -> int:
        return self.codes.shape[1] * (8 // self.bits)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, k], rounded as gguf's dequantization rounds."""
        q = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
        rows = q.shape[0]
        q = q.reshape(rows, -1, self.block).astype(np.float32)
        w = q * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(rows, -1)


def decode(raw: np.ndarray, qtype: QType) -> Blocks:
    """The blocks of a GGUF tensor's data as GGUFReader gives it (uint8 [rows, bytes])."""
    rows = raw.shape[0]
    if qtype == QType.Q8_0:
        b = raw.reshape(rows, -1, 34)
        return Blocks(
            _contig(b[..., 2:].view(np.int8).reshape(rows, -1)), _f16(b[..., :2]), None, 32
        )
    if qtype in (QType.Q4_0, QType.Q4_1):
        width = 18 if qtype == QType.Q4_0 else 20
        b = raw.reshape(rows, -1, width)
        scales = _f16(b[..., :2])
        mins = -8 * scales if qtype == QType.Q4_0 else _f16(b[..., 2:4])
        qs = b[..., width - 16 :]
        # A block's byte j holds element j (low nibble) and j + 16 (high).
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return Blocks(pack_nibbles(q.reshape(rows, -1)), scales, mins, 32)
    if qtype == QType.Q4_K:
        supers = raw.reshape(rows * (raw.shape[1] // 144), 144)
        d, dmin = _f16(supers[:, 0:2])[:, None], _f16(supers[:, 2:4])[:, None]
        sc, m = Q4_K.get_scale_min(supers[:, 4:16])
        # Byte j of each 32-byte chunk c holds sub-block 2c's element j (low nibble)
        # and sub-block 2c + 1's (high).
        qs = supers[:, 16:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        return Blocks(
            pack_nibbles(q.reshape(rows, -1)),
            (d * sc.astype(np.float32)).reshape(rows, -1),
            (-(dmin * m.astype(np.float32))).reshape(rows, -1),
            32,
        )
    if qtype == QType.Q6_K:
        supers = raw.reshape(rows * (raw.shape[1] // 210), 210)
        ql, qh = supers[:, :128], supers[:, 128:192]
        sc, d = supers[:, 192:208].view(np.int8), _f16(supers[:, 208:210])[:, None]
        # As gguf.quants.Q6_K: 4 low bits from ql, 2 high bits from qh, minus 32.
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (
            qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
        return Blocks(
            _contig(q.reshape(rows, -1)), (d * sc.astype(np.float32)).reshape(rows, -1), None, 16
        )
    raise ValueError(f"GGUF type {qtype.name} is not kept quantized (supported: {_names()})")


def common_layout(parts: list[Blocks]) -> list[Blocks]:
    """`parts` (of one fused projection: q/k/v, gate/up) in one layout, exactly: 8-bit
    codes if any part has them, the smallest block, mins if any part has them (zeros
    where a part had none). A Q4_K_M file stores v (and down) in Q6_K beside Q4_K."""
    bits = max(p.bits for p in parts)
    block = min(p.block for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    return [_widen(p, bits, block, with_mins) for p in parts]


def _widen(p: Blocks, bits: int, block: int, with_mins: bool) -> Blocks:
    if (p.bits, p.block, p.mins is not None) == (bits, block, with_mins):
        return p
    codes = p.codes if p.bits == bits else unpack_nibbles(p.codes).astype(np.int8)
    repeat = p.block // block
    scales = np.repeat(p.scales, repeat, axis=1)
    mins = None
    if with_mins:
        mins = np.zeros_like(scales) if p.mins is None else np.repeat(p.mins, repeat, axis=1)
    return Blocks(codes, scales, mins, block)


def narrowest_scales(scales: np.ndarray, mins: np.ndarray | None) -> np.dtype:
    """float16 where every scale and min is one exactly (Q8_0, Q4_0, Q4_1: the file's
    own), else float32 (the K-quants' products)."""
    for t in (scales, mins):
        if t is not None and not np.array_equal(t.astype(np.float16).astype(np.float32), t):
            return np.dtype(np.float32)
    return np.dtype(np.float16)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [rows, k] of values 0..15 -> [rows, k / 2]: element 2j low, 2j + 1 high."""
    q = q.astype(np.uint8)
    return _contig(q[:, 0::2] | (q[:, 1::2] << 4))


def unpack_nibbles(codes: np.ndarray) -> np.ndarray:
    """pack_nibbles' inverse: uint8 [rows, k]."""
    return np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(codes.shape[0], -1)


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes at the end of `b`'s shape) -> float32, without the 2."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _contig(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)


def _names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)
