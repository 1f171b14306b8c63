"""Flat KV slot tables for the kernels, built on the device once per forward pass.

Request r's first `lens[r]` positions map to kv_indices[kv_indptr[r]:kv_indptr[r + 1]],
read from its req_to_token row. req_to_token holds a slot for every position whatever
the page size, so the kernels never see pages. A handful of vectorised torch ops, no
loop over requests, and no device-to-host sync: the total length comes from the
host-side copy of the lengths.
"""

from __future__ import annotations

import torch


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
