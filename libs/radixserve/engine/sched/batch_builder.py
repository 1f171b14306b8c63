"""Turns the step's plan (requests with their extend lengths) into a ForwardBatch.

The host walks the requests once to collect plain integers (token ids, lengths,
rows), uploads them in ONE host-to-device copy, and slices that tensor into the
batch's fields; the new tokens' KV slots come from req_to_token in one gather on
the device (the KV manager wrote them there when it assigned them). So a step costs
the same few device operations at batch 1 and at batch 256, and nothing waits for
the device.
"""

from __future__ import annotations

import torch

from radixserve.engine.forward_batch import (
    DECODE_INPUT_FIELDS,
    ForwardBatch,
    ForwardMode,
    SharedPrefix,
)
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import Req
from radixserve.engine.transfer import upload_int64


def tokens_at(req: Req, start: int, end: int) -> list[int]:
    """The request's token ids at positions [start, end) of prompt + output, without
    building the whole concatenation (`Req.fill_ids`) for a slice of it. A token still
    on the device (overlap scheduling) is `future_id(req)`, resolved on the device."""
    prompt = req.origin_input_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    known = n + len(req.output_ids)
    if end > known:
        assert end == known + 1 and req.num_pending, "only the last token can be pending"
        return [*tokens_at(req, start, known), future_id(req)]
    if start >= n:
        return req.output_ids[start - n : end - n]
    return prompt[start:] + req.output_ids[: end - n]


def future_id(req: Req) -> int:
    """The input id standing for the request's pending token: -(its row + 1) in the
    sampled ids of the step in flight (see sched/overlap.py)."""
    return -(req.future_row + 1)


def build_forward_batch(
    reqs: list[Req],
    kv_pool: KVPool,
    req_pool: ReqToTokenPool,
    device: torch.device,
    shared_prefixes: tuple[SharedPrefix, ...] = (),
) -> ForwardBatch:
    """`shared_prefixes`: groups for cascade attention, among the batch's leading
    one-token requests (ForwardBatch.cascade_rows)."""
    if all(req.extend_len == 1 for req in reqs):
        batch = _build_decode(reqs, kv_pool, req_pool, device)
    else:
        batch = _build_extend(reqs, kv_pool, req_pool, device)
    rows = batch.cascade_rows
    if any(i >= rows for group in shared_prefixes for i in group.members):
        raise ValueError("shared-prefix members must be among the leading one-token requests")
    batch.shared_prefixes = shared_prefixes
    return batch


def _build_decode(
    reqs: list[Req], kv_pool: KVPool, req_pool: ReqToTokenPool, device: torch.device
) -> ForwardBatch:
    """Every request adds one token: its position is its kv_len."""
    bs = len(reqs)
    input_ids: list[int] = []
    kv_lens: list[int] = []
    rows: list[int] = []
    for req in reqs:
        assert req.req_pool_idx is not None
        pos = req.kv_len
        prompt = req.origin_input_ids
        out = pos - len(prompt)
        if out < 0:
            input_ids.append(prompt[pos])
        else:
            input_ids.append(req.output_ids[out] if out < len(req.output_ids) else future_id(req))
        kv_lens.append(pos)
        rows.append(req.req_pool_idx)
    seq_lens = [n + 1 for n in kv_lens]
    ones = [1] * bs
    # Rows in DECODE_INPUT_FIELDS order (the slots, row 2, are filled in on the device),
    # then the two per-request constants.
    packed = upload_int64(
        input_ids + kv_lens + [0] * bs + rows + seq_lens + ones + list(range(bs)), device
    ).view(7, bs)
    input_ids_t, positions, out_cache_loc, rows_t, seq_lens_t, extend_lens_t, starts_t = packed
    table = req_pool.req_to_token
    out_cache_loc.copy_(table[rows_t, positions])
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids_t,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=rows_t,
        seq_lens=seq_lens_t,
        extend_prefix_lens=positions,  # a decode request's prefix is everything before it
        extend_seq_lens=extend_lens_t,
        extend_start_loc=starts_t,
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=kv_lens,
        extend_seq_lens_cpu=ones,
        decode_inputs=packed[: len(DECODE_INPUT_FIELDS)],
    )


def _build_extend(
    reqs: list[Req], kv_pool: KVPool, req_pool: ReqToTokenPool, device: torch.device
) -> ForwardBatch:
    bs = len(reqs)
    input_ids: list[int] = []
    positions: list[int] = []
    token_rows: list[int] = []  # each new token's request row, for the slot gather
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    seq_lens: list[int] = []
    rows: list[int] = []
    starts: list[int] = []
    num_tokens = 0
    for req in reqs:
        row = req.req_pool_idx
        assert row is not None and req.extend_len > 0
        start, n = req.kv_len, req.extend_len
        input_ids.extend(tokens_at(req, start, start + n))
        positions.extend(range(start, start + n))
        token_rows.extend([row] * n)
        prefix_lens.append(start)
        extend_lens.append(n)
        seq_lens.append(start + n)
        rows.append(row)
        starts.append(num_tokens)
        num_tokens += n
    packed = upload_int64(
        input_ids + positions + token_rows + rows + seq_lens + prefix_lens + extend_lens + starts,
        device,
    )
    per_token = packed[: 3 * num_tokens].view(3, num_tokens)
    per_req = packed[3 * num_tokens :].view(5, bs)
    input_ids_t, positions_t, token_rows_t = per_token
    rows_t, seq_lens_t, prefix_lens_t, extend_lens_t, starts_t = per_req
    table = req_pool.req_to_token
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=input_ids_t,
        positions=positions_t,
        out_cache_loc=table[token_rows_t, positions_t].to(torch.int64),
        req_pool_indices=rows_t,
        seq_lens=seq_lens_t,
        extend_prefix_lens=prefix_lens_t,
        extend_seq_lens=extend_lens_t,
        extend_start_loc=starts_t,
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
    )
