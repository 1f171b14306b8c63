"""The FP8 format of the projections (kernels/fp8.py) and their Triton kernels: e4m3
codes, the largest code, and the least scale a row takes."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The least scale a row takes (vLLM's): an all-zero row gets codes of 0, not 0 / 0.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
