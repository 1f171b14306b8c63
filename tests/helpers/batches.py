"""Build `ForwardBatch`es by hand over real KV pools, the way the scheduler would."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool


class PagedRequests:
    """Tracks requests' rows and KV lengths; each `build` appends their new tokens."""

    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.kv_lens: dict[int, int] = {}

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        if row is None:
            raise RuntimeError("no free request rows")
        self.kv_lens[row] = 0
        return row

    def build(
        self, mode: ForwardMode, new_tokens: Sequence[tuple[int, Sequence[int]]]
    ) -> ForwardBatch:
        """One pass in which request `row` adds `ids`, for each (row, ids), in that order."""
        device = self.kv_pool.device
        input_ids: list[int] = []
        positions: list[int] = []
        locs: list[torch.Tensor] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        for row, ids in new_tokens:
            start = self.kv_lens[row]
            slots = self.kv_pool.alloc(len(ids))
            if slots is None:
                raise RuntimeError("KV pool exhausted")
            self.req_pool.req_to_token[row, start : start + len(ids)] = slots.to(torch.int32)
            input_ids.extend(ids)
            positions.extend(range(start, start + len(ids)))
            locs.append(slots)
            prefix_lens.append(start)
            extend_lens.append(len(ids))
            self.kv_lens[row] = start + len(ids)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return ForwardBatch(
            mode=mode,
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=tensor([row for row, _ in new_tokens]),
            seq_lens=tensor(seq_lens),
            extend_prefix_lens=tensor(prefix_lens),
            extend_seq_lens=tensor(extend_lens),
            extend_start_loc=tensor(starts),
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
        )
