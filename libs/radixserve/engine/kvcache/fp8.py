"""The FP8 KV cache's format: e4m3 codes with one scale per layer for K and one for V.

A stored row is code = saturate(x / scale) cast to float8_e4m3fn; a read gives back
code * scale, widened to float32 before the multiply (what every backend does, so the
torch reference and the kernels see the same values). Scales come from the checkpoint
(model/kv_scales.py) or are 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.config import KV_CACHE_DTYPES
from radixserve.engine.kernels.fp8_format import FP8_DTYPE, FP8_MAX


@dataclass(frozen=True)
class KVScale:
    """One layer's dequantizing scales: stored K codes times `k` are its keys, V's times `v`."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            value = getattr(self, name)
            if not (value > 0 and value < float("inf")):  # NaN too
                raise ValueError(f"a KV cache {name}_scale must be finite and > 0, got {value}")


UNIT_SCALE = KVScale()


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV buffers store for EngineConfig.kv_cache_dtype `name`."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 codes of x / scale, saturated to +-FP8_MAX (a cast alone would make NaNs)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def widen(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V rows as `dtype` values: codes * scale for FP8, else a cast."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)
