"""SiLU(gate) x up over the fused gate_up projection output.

The Triton kernel computes SiLU in float32 as torch does (x / (1 + exp(-x))), rounds
it to the input dtype, then rounds the product: on CUDA with the exp (libdevice's
expf) and the IEEE division torch's kernel uses, so 16-bit results match it bit for
bit unless the two exps differ; an ulp of SiLU is 2 ulps of the product at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.engine.kernels import dispatch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [tokens, 2 * n] holding gate then up; -> [tokens, n]."""
    if dispatch.use_triton(gate_up):
        from radixserve.engine.kernels.triton_ops.activation import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
