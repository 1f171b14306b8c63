"""The split-KV decode kernel (triton_ops/decode.py) on its own: inputs over flat slot
tables, its two paths (one-pass, and stage 1 + stage 2) and a torch reference.

Shared by the CPU (Triton interpreter) and the CUDA attention tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.attention.triton_ops.decode import (
    decode_attention,
    decode_partials,
    decode_reduce,
)

# What the rows of `out` that no request owns hold before and after a kernel runs.
UNTOUCHED = 1234.0


@dataclass
class DecodeCase:
    q: torch.Tensor  # [num_tokens, heads, head_dim]
    k_buffer: torch.Tensor  # [pool slots, kv_heads, head_dim]
    v_buffer: torch.Tensor
    q_rows: torch.Tensor  # [bs] int64
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # int32
    scale: float


def make_case(
    seq_lens: list[int],
    q_rows: list[int],  # each request's token row, in a batch of max(q_rows) + 2 tokens
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> DecodeCase:
    """Random q/K/V, each request's slots scattered over a pool larger than the batch."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    pool = total + 37

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    indptr = [0]
    for n in seq_lens:
        indptr.append(indptr[-1] + n)
    return DecodeCase(
        q=noise(max(q_rows) + 2, heads, head_dim),
        k_buffer=noise(pool, kv_heads, head_dim),
        v_buffer=noise(pool, kv_heads, head_dim),
        q_rows=torch.tensor(q_rows, dtype=torch.int64, device=device),
        kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        kv_indices=torch.randperm(pool, generator=gen)[:total].to(torch.int32).to(device),
        scale=1.3 / head_dim**0.5,
    )


def reference(case: DecodeCase) -> torch.Tensor:
    """[bs, heads, head_dim] float32: softmax attention of each request's query row over
    its slots, in float32."""
    group = case.q.shape[1] // case.k_buffer.shape[1]
    indptr = case.kv_indptr.tolist()
    rows = []
    for r, row in enumerate(case.q_rows.tolist()):
        slots = case.kv_indices[indptr[r] : indptr[r + 1]].long()
        k = case.k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, heads, d]
        v = case.v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", case.q[row].float(), k) * case.scale
        rows.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(rows)


def run_kernel(case: DecodeCase, num_splits: int, *, two_stage: bool = False) -> torch.Tensor:
    """`out` after decode_attention (one-pass at one split), or after decode_partials +
    decode_reduce; its other rows are filled with UNTOUCHED first. Also checks that
    the one-pass path leaves the split scratch alone."""
    bs = case.q_rows.shape[0]
    heads, head_dim = case.q.shape[1], case.q.shape[2]
    device = case.q.device
    out = torch.full_like(case.q, UNTOUCHED)
    mid_out = torch.full((bs, heads, num_splits, head_dim), UNTOUCHED, device=device)
    mid_lse = torch.full((bs, heads, num_splits), UNTOUCHED, device=device)
    tables = (case.q_rows, case.kv_indptr, case.kv_indices)
    if two_stage:
        decode_partials(case.q, case.k_buffer, case.v_buffer, *tables, mid_out, mid_lse, case.scale)
        decode_reduce(mid_out, mid_lse, out, case.q_rows, case.kv_indptr)
    else:
        decode_attention(
            case.q, case.k_buffer, case.v_buffer, out, *tables, mid_out, mid_lse, case.scale
        )
        if num_splits == 1:
            assert (mid_out == UNTOUCHED).all() and (mid_lse == UNTOUCHED).all()
    return out


def relative_error(case: DecodeCase, out: torch.Tensor) -> float:
    """Worst |out - reference| over max |reference| on the requests' rows; asserts the
    other rows of `out` were not written."""
    owned = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    owned[case.q_rows] = True
    assert (out[~owned] == UNTOUCHED).all(), "a row no request owns was written"
    ref = reference(case)
    return float((out[case.q_rows].float() - ref).abs().max() / ref.abs().max())
