"""Write a step's new K and V rows into one layer's KV buffers at their slots.

One Triton kernel on CUDA writes both (torch's indexed assignment is two kernels, one
per buffer, for every layer of every step); k and v may be strided views (v is a
slice of the fused qkv output). The torch reference runs elsewhere. A copy: exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.kernels import dispatch


@dataclass(frozen=True)
class KVWrite:
    """One layer's store of a step's new rows, k still to come: k and `v` rows go to
    slots `loc` of `k_buffer` and `v_buffer` (the rotary kernel takes it, see
    kernels/rotary.apply_rotary_and_store)."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    v: torch.Tensor


def triton_stores(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Triton kernels store these rows: on CUDA, each row's head_dim contiguous."""
    return dispatch.use_triton(k) and k.stride(-1) == 1 and v.stride(-1) == 1


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v ([tokens, kv_heads, head_dim] rows, cast
    to the buffers' dtype)."""
    if triton_stores(k, v):
        from radixserve.engine.kernels.triton_ops.kv_store import store_kv_triton

        store_kv_triton(k_buffer, v_buffer, loc, k, v)
        return
    store_kv_torch(k_buffer, v_buffer, loc, k, v)


def store_kv_torch(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)
