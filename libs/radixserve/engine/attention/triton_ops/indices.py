"""Flat KV slot tables for the kernels, built on the device once per forward pass.

Request r's first `lens[r]` positions map to kv_indices[kv_indptr[r]:kv_indptr[r + 1]],
read from its req_to_token row. req_to_token holds a slot for every position whatever
the page size, so the kernels never see pages.

- `build_kv_indices`: a handful of vectorised torch ops, no loop over requests, and no
  device-to-host sync: the total length comes from the host-side copy of the lengths.
- `gather_kv_rows`: the same table into a fixed buffer, with the lengths read on the
  device only (one Triton kernel), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def build_kv_indices(
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    req_pool_indices: torch.Tensor,  # [bs] int64, each request's row
    lens: torch.Tensor,  # [bs] int64 on the device: how many positions to take per request
    total: int,  # sum(lens), known on the host
    starts: torch.Tensor | None = None,  # [bs] int64: first position taken (default 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [bs + 1] int32, kv_indices [max(total, 1)] int32): request r's
    positions [starts[r], starts[r] + lens[r])."""
    device = req_to_token.device
    bs = lens.shape[0]
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    if total == 0:
        # Nothing to read (no request has a cached prefix); one dummy entry keeps the
        # kernel argument a real allocation.
        return kv_indptr, torch.zeros(1, dtype=torch.int32, device=device)
    rows = torch.repeat_interleave(req_pool_indices, lens, output_size=total)
    offsets = torch.repeat_interleave(kv_indptr[:-1].to(torch.int64), lens, output_size=total)
    cols = torch.arange(total, dtype=torch.int64, device=device) - offsets
    if starts is not None:
        cols += torch.repeat_interleave(starts, lens, output_size=total)
    return kv_indptr, req_to_token[rows, cols]


_GATHER_BLOCK = 512


@triton.jit
def _gather_kv_rows_kernel(
    req_to_token,  # [rows, max_context] int32
    stride_row,
    req_pool_indices,  # [bs] int64
    lens,  # [bs] int64
    starts,  # [bs] int64 (read only if HAS_STARTS)
    kv_indptr,  # [bs + 1] int32
    kv_indices,  # int32, written at [kv_indptr[r], kv_indptr[r + 1])
    HAS_STARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    length = tl.load(lens + req)
    first = tl.load(starts + req).to(tl.int64) if HAS_STARTS else 0
    dst = tl.load(kv_indptr + req).to(tl.int64)
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(req_to_token + row * stride_row + first + offs, mask=mask)
        tl.store(kv_indices + dst + offs, slots, mask=mask)


def gather_kv_rows(
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    lens: torch.Tensor,  # [bs] int64
    kv_indptr: torch.Tensor,  # [bs + 1] int32, entry 0 zero: written here from lens
    kv_indices: torch.Tensor,  # int32 buffer holding at least sum(lens) entries
    starts: torch.Tensor | None = None,  # [bs] int64: first position taken (default 0)
) -> None:
    """build_kv_indices into fixed buffers, queued on the device with no host sync."""
    bs = lens.shape[0]
    kv_indptr[1 : bs + 1].copy_(torch.cumsum(lens, 0))
    _gather_kv_rows_kernel[(bs,)](
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        lens,
        lens if starts is None else starts,
        kv_indptr,
        kv_indices,
        HAS_STARTS=starts is not None,
        BLOCK=_GATHER_BLOCK,
    )
