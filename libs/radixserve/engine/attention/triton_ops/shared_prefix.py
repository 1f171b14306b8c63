"""Cascade decode attention: a prefix shared by a group of requests is read once.

Requests that share their first `length` KV slots (one path of the radix cache) each
attend over [shared prefix | own suffix]. Attending the two parts separately and
merging them by their log-sum-exps gives the same softmax. The suffix part is the
ordinary split-KV decode (decode.py) over each request's own slots; the prefix part
is this file's kernel, which stacks the query heads of EVERY member of a group that
share a KV head into the rows of one tile, so each K/V block of the prefix is loaded
once per group instead of once per member (a 16-member group with 4 query heads per KV
head fills a 64-row tensor-core tile). Its grid runs over a list of tiles (a group's
members cut into tiles of at most MEMBERS_PER_TILE), KV heads and splits; a tile with
no members is padding and does nothing, so a CUDA graph can launch a fixed grid.

Both parts write normalised partial outputs and log2-sum-exp2s into one scratch
[bs, num_heads, num_splits, head_dim] array, the prefix into splits [0, prefix_splits)
and the suffix into the rest; the merge kernel folds every written split of a request.
Splits nobody writes (a request outside any group has no prefix part; short suffixes
leave trailing splits empty) must hold -inf in the lse scratch: the caller fills it
once per forward pass, since every layer writes the same splits.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from radixserve.engine.attention.triton_ops.common import (
    LOG2E,
    attend_paged_range,
    dot_precision,
    fold_partial,
    kv_fp8,
    programmatic_launch,
)
from radixserve.engine.attention.triton_ops.decode import LaunchOptions
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale

_BLOCK_M = 64  # query rows per tile: members x query heads of one KV head
# Keys per loop step and launch options of the prefix kernel: the best of
# lab/probes/cascade_attention.py --sweep (measured:
# lab/notebook/2026-11-23-cascade-kernels-rotary-logits-radix-walk.md).
PREFIX_OPTIONS = LaunchOptions(block_n=64, num_warps=4, num_stages=3)


def tile_rows(group_size: int) -> int:
    """Rows of a prefix tile: a power of two holding at least one member's query heads."""
    return max(_BLOCK_M, triton.next_power_of_2(group_size))


def members_per_tile(group_size: int) -> int:
    return tile_rows(group_size) // group_size


def prefix_tiles(member_indptr: list[int], per_tile: int) -> list[list[int]]:
    """[groups, firsts, ends]: group g's members (members[member_indptr[g]:
    member_indptr[g + 1]]) cut into tiles of at most `per_tile`."""
    tiles: list[list[int]] = [[], [], []]
    for group, (lo, hi) in enumerate(itertools.pairwise(member_indptr)):
        for first in range(lo, hi, per_tile):
            tiles[0].append(group)
            tiles[1].append(first)
            tiles[2].append(min(first + per_tile, hi))
    return tiles


# num_splits changes from pass to pass: one compiled kernel for every value.
@triton.jit(do_not_specialize=["num_splits"])
def _shared_prefix_kernel(
    Q,  # [bs, num_heads, head_dim]: one token per request, row = batch index
    members,  # [num_members] int64 batch indices, grouped by prefix
    tile_group,  # [num_tiles] int64: the group (prefix) of tile t ...
    tile_lo,  # [num_tiles] int64 ... and its members, members[tile_lo[t]:tile_hi[t]]
    tile_hi,  # (at most MEMBERS_PER_TILE; an empty range is a padding tile)
    K_Buffer,
    V_Buffer,
    kv_indptr,  # [num_groups + 1] int32 over the prefix lengths
    kv_indices,  # int32 slots of the prefixes
    Mid_O,  # [bs, num_heads, num_splits, head_dim] fp32
    Mid_Lse,  # [bs, num_heads, num_splits] fp32
    sm_scale_log2,
    num_splits,
    k_scale,  # where KV_FP8: the pool's codes times these are K and V
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    stride_lse_t,
    stride_lse_h,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    MEMBERS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RELEASE: tl.constexpr,  # let a programmatic dependent (decode_merged) launch now
    KV_FP8: tl.constexpr,  # the pool holds e4m3 codes
):
    if RELEASE:
        # Its programs attend over their own suffixes while this kernel's last ones run,
        # and wait for this kernel only to fold its partials in.
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    group = tl.load(tile_group + tile)
    first = tl.load(tile_lo + tile)
    end = tl.load(tile_hi + tile)
    offs_m = tl.arange(0, BLOCK_M)
    member = first + offs_m // GROUP_SIZE
    row_mask = (offs_m < MEMBERS_PER_TILE * GROUP_SIZE) & (member < end)
    req = tl.load(members + member, mask=row_mask, other=0)
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        Q + req[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )

    kv_start = tl.load(kv_indptr + group)
    # A padding tile (no members) reads nothing.
    prefix_len = tl.where(end > first, tl.load(kv_indptr + group + 1) - kv_start, 0)
    split_len = tl.cdiv(prefix_len, num_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = attend_paged_range(
        q,
        kv_indices + kv_start,
        lo,
        hi,
        K_Buffer,
        V_Buffer,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        kv_head,
        offs_d,
        d_mask,
        sm_scale_log2,
        m_i,
        l_i,
        acc,
        0,
        1.0,
        k_scale,
        v_scale,
        BLOCK_N,
        DOT_PRECISION,
        False,  # cascade runs full attention only (base.AttentionBackend.set_layers)
        False,
        KV_FP8,
    )

    if hi > lo:
        mid = req * stride_mid_t + heads * stride_mid_h + split * stride_mid_s
        tl.store(Mid_O + mid[:, None] + offs_d[None, :], acc / l_i[:, None], mask=q_mask)
        lse = req * stride_lse_t + heads * stride_lse_h + split
        tl.store(Mid_Lse + lse, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    Mid_O,
    Mid_Lse,  # -inf where a split was not written
    Out,  # [bs, num_heads, head_dim]
    num_splits,
    stride_mid_t,
    stride_mid_h,
    stride_mid_s,
    stride_lse_t,
    stride_lse_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(Mid_Lse + req * stride_lse_t + head * stride_lse_h + split)
        written = lse > float("-inf")
        mid = req * stride_mid_t + head * stride_mid_h + split * stride_mid_s
        part = tl.load(Mid_O + mid + offs_d, mask=d_mask, other=0.0)
        # An unwritten split's output is stale scratch (maybe NaN): dropped, not weighted.
        part = tl.where(written, part, 0.0)
        m, total, acc = fold_partial(m, total, acc, lse, part)
    out = (acc / total).to(Out.dtype.element_ty)
    tl.store(Out + req * stride_ot + head * stride_oh + offs_d, out, mask=d_mask)


def shared_prefix_attention(
    q: torch.Tensor,  # [bs, num_heads, head_dim]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    members: torch.Tensor,
    tiles: torch.Tensor,  # [3, num_tiles] int64: group, first and end member of each tile
    kv_indptr: torch.Tensor,  # [num_groups + 1] int32 over the prefix lengths
    kv_indices: torch.Tensor,
    mid_out: torch.Tensor,  # [bs, num_heads, prefix_splits, head_dim] fp32 (a view)
    mid_lse: torch.Tensor,  # [bs, num_heads, prefix_splits] fp32 (a view)
    scale: float,
    *,
    options: LaunchOptions | None = None,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Each tile's members attend over their group's prefix: partial outputs into
    mid_out/mid_lse (`prefix_tiles` cuts the groups into tiles). `options` default to
    PREFIX_OPTIONS; others are for lab/probes/cascade_attention.py's sweep. `kv_scale`:
    an FP8 pool's scales for this layer."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group_size = num_heads // num_kv_heads
    num_splits = mid_out.shape[2]
    assert mid_out.stride(3) == 1 and mid_lse.stride(2) == 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    options = options or PREFIX_OPTIONS
    grid = (tiles.shape[1], num_kv_heads, num_splits)
    _shared_prefix_kernel[grid](
        q,
        members,
        tiles[0],
        tiles[1],
        tiles[2],
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        mid_out,
        mid_lse,
        scale * LOG2E,
        num_splits,
        kv_scale.k,
        kv_scale.v,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP_SIZE=group_size,
        MEMBERS_PER_TILE=members_per_tile(group_size),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=tile_rows(group_size),
        BLOCK_N=options.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        RELEASE=programmatic_launch(q.device),
        KV_FP8=kv_fp8(k_buffer),
        num_warps=options.num_warps,
        num_stages=options.num_stages,
    )


def merge_splits(mid_out: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[r, h] = the softmax-weighted merge of every written split of (r, h)."""
    bs, num_heads, num_splits, head_dim = mid_out.shape
    assert mid_out.stride(3) == 1 and mid_lse.stride(2) == 1
    _merge_splits_kernel[(bs, num_heads)](
        mid_out,
        mid_lse,
        out,
        num_splits,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=4 if head_dim > 64 else 2,
    )
