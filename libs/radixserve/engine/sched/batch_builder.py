"""Turns the step's plan (requests with their extend lengths) into a ForwardBatch."""

from __future__ import annotations

import torch

from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import Req


def build_forward_batch(
    reqs: list[Req], kv_pool: KVPool, req_pool: ReqToTokenPool, device: torch.device
) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    seq_lens: list[int] = []
    rows: list[int] = []
    for req in reqs:
        assert req.req_pool_idx is not None and req.extend_len > 0
        start, end = req.kv_len, req.kv_len + req.extend_len
        input_ids.extend(req.fill_ids[start:end])
        positions.extend(range(start, end))
        prefix_lens.append(start)
        extend_lens.append(req.extend_len)
        seq_lens.append(end)
        rows.append(req.req_pool_idx)
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    table = req_pool.req_to_token
    rows_t = torch.tensor(rows, dtype=torch.int64)
    # Slots were written into req_to_token at allocation; gather them per request.
    out_cache_loc = torch.cat(
        [
            table[row, p : p + n].to(torch.int64)
            for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True)
        ]
    )
    mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return ForwardBatch(
        mode=mode,
        input_ids=dev(input_ids),
        positions=dev(positions),
        out_cache_loc=out_cache_loc.to(device, non_blocking=True),
        req_pool_indices=rows_t.to(device, non_blocking=True),
        seq_lens=dev(seq_lens),
        extend_prefix_lens=dev(prefix_lens),
        extend_seq_lens=dev(extend_lens),
        extend_start_loc=dev(starts),
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
    )
