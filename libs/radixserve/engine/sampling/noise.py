"""Counter-based random numbers: one uniform per (seed, output position), from integer ops.

A request's random draw at step t is a pure function of (seed, t): it does not depend on
which requests share the batch, on the device, or on any generator state, so a retracted
and recomputed request, or a request replayed alone, draws the same number.

The hash is MurmurHash3's 32-bit finalizer chained over the words of (seed, step), on
numpy uint32 arrays: unsigned array arithmetic wraps modulo 2**32 by definition (torch's
signed int64 overflow would be undefined behaviour), and for the few hundred rows of a
batch numpy's per-op overhead is a quarter of torch's. The result is uploaded with the
batch's other per-row floats.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

U32 = npt.NDArray[np.uint32]

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
_FMIX_C1 = np.uint32(0x85EBCA6B)
_FMIX_C2 = np.uint32(0xC2B2AE35)
_CHAIN_START = np.uint32(0x9E3779B9)  # golden ratio: a non-zero start for seed 0, step 0
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and never rounds up to 1.0


def fmix32(x: U32) -> U32:
    """MurmurHash3's finalizer: a bijection on 32-bit words with full avalanche."""
    x = x ^ (x >> np.uint32(16))
    x = x * _FMIX_C1
    x = x ^ (x >> np.uint32(13))
    x = x * _FMIX_C2
    return x ^ (x >> np.uint32(16))


def split_seed(seed: int) -> tuple[int, int]:
    """Any Python int seed -> its low and high 32-bit words (mod 2**64)."""
    value = seed & MASK64
    return value & MASK32, value >> 32


def hash_words(seed_lo: U32, seed_hi: U32, step: U32) -> U32:
    """A 32-bit hash of each row's (seed, step)."""
    h = fmix32(np.full_like(seed_lo, _CHAIN_START) ^ seed_lo)
    h = fmix32(h ^ seed_hi)
    return fmix32(h ^ step)


def uniform_from_hash(h: U32) -> npt.NDArray[np.float32]:
    """32-bit hashes -> float32 uniforms in the open interval (0, 1)."""
    top = (h >> np.uint32(32 - _UNIFORM_BITS)).astype(np.float32)
    # Centre of each of the 2**23 cells: never exactly 0 or 1.
    return (top + np.float32(0.5)) * np.float32(1.0 / (1 << _UNIFORM_BITS))


def row_uniforms(seeds: list[int], steps: list[int]) -> npt.NDArray[np.float32]:
    """One uniform in (0, 1) per row, a pure function of that row's (seed, step)."""
    words = [split_seed(seed) for seed in seeds]
    lo = np.array([w[0] for w in words], dtype=np.uint32)
    hi = np.array([w[1] for w in words], dtype=np.uint32)
    step = np.array([s & MASK32 for s in steps], dtype=np.uint32)
    return uniform_from_hash(hash_words(lo, hi, step))
