"""Cascade decode: requests that share a cached prefix read it from HBM once per step.

A decode batch's `shared_prefixes` (found by the scheduler on the radix tree) name
groups of requests whose first `length` KV slots are the same. Without cascade every
member reads that prefix on its own at every step: 16 requests over a 2048-token
system prompt read it 16 times. Here the group's members attend over the prefix
together (triton_ops/shared_prefix.py: their query heads stacked in one tile), each
request attends over the rest of its own KV with the split-KV decode kernel, and the
partial results are merged by their log-sum-exps: the same softmax, fewer bytes.
Each layer runs two kernels over tables built once per pass (three where the suffix
takes several splits: a merge kernel then folds them with the prefix's):

- `CascadeDecode`, an eager pass (a decode batch, or the leading decoding rows of a
  mixed one): the tables are uploaded and built for this batch.
- `CascadeGraph`, passes captured in CUDA graphs (one per graph size, beside the plain
  decode graphs): the tables live in fixed buffers. Before a replay, `write` puts the
  step's groups there in one host-to-device copy (members, each group's prefix length
  and leader, the tiles of members the prefix kernel runs, each request's prefix
  length); the captured pass builds the slot tables from them on the device and runs
  the kernels over fixed grids, padding tiles and groups doing nothing. The split
  counts are fixed per graph size. A graph of `bs` requests holds at most
  `max_groups(bs)` groups: past that, the groups that save the fewest bytes are left
  out and their members read their whole KV as plain requests do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from radixserve.engine.attention.triton_ops.common import num_sms
from radixserve.engine.attention.triton_ops.decode import (
    MAX_SPLITS,
    decode_merged,
    decode_partials,
    graph_num_kv_splits,
    num_kv_splits,
)
from radixserve.engine.attention.triton_ops.indices import build_kv_indices, gather_kv_rows
from radixserve.engine.attention.triton_ops.shared_prefix import (
    members_per_tile,
    merge_splits,
    prefix_tiles,
    shared_prefix_attention,
)
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode, SharedPrefix
from radixserve.engine.kvcache.fp8 import UNIT_SCALE, KVScale
from radixserve.engine.transfer import upload, upload_int64, upload_into

# A split of the prefix shorter than this costs more to merge than it adds in parallelism.
_MIN_PREFIX_TOKENS_PER_SPLIT = 256


def max_groups(bs: int) -> int:
    """Groups a captured cascade pass of `bs` requests holds: every padding tile of its
    fixed grid is a program launched for nothing, so the bound is kept well below bs/2."""
    return max(1, bs // 8)


def _prefix_splits(programs: int, device: torch.device, max_prefix: int | None = None) -> int:
    """Splits of each prefix: enough programs for one per SM and, where the longest
    prefix is known (not in a graph), none shorter than _MIN_PREFIX_TOKENS_PER_SPLIT.
    (Each split adds partials to write and merge; measured: lab/notebook/2026-12-01-figures-from-code-comments.md.)"""
    wanted = triton.next_power_of_2(triton.cdiv(num_sms(device), max(1, programs)))
    if max_prefix is not None:
        wanted = min(
            wanted, triton.next_power_of_2(triton.cdiv(max_prefix, _MIN_PREFIX_TOKENS_PER_SPLIT))
        )
    return max(1, min(wanted, MAX_SPLITS))


@dataclass
class _Tables:
    """One pass's device tables (views of fixed buffers in a graph)."""

    members: torch.Tensor  # int64 batch indices, grouped by prefix
    tiles: torch.Tensor  # [3, num_tiles] int64: group, first and end member of each tile
    prefix_indptr: torch.Tensor  # [num_groups + 1] int32
    prefix_indices: torch.Tensor  # int32 slots of the prefixes
    suffix_indptr: torch.Tensor  # [bs + 1] int32 over each request's KV past its prefix
    suffix_indices: torch.Tensor
    q_rows: torch.Tensor  # [bs] int64: arange (request r's token is row r)


def _attend(
    t: _Tables,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    scale: float,
    mid_out: torch.Tensor,  # [bs, num_heads, prefix_splits + suffix splits, head_dim] fp32
    mid_lse: torch.Tensor,  # -inf wherever neither part writes
    prefix_splits: int,
    out: torch.Tensor | None = None,  # [bs, num_heads, head_dim], else a new tensor
    kv_scale: KVScale = UNIT_SCALE,  # an FP8 pool's scales for this layer
) -> torch.Tensor:
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels assume dense head_dim
    split = prefix_splits
    shared_prefix_attention(
        q,
        k_buffer,
        v_buffer,
        t.members,
        t.tiles,
        t.prefix_indptr,
        t.prefix_indices,
        mid_out[:, :, :split],
        mid_lse[:, :, :split],
        scale,
        kv_scale=kv_scale,
    )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    suffix = (q, k_buffer, v_buffer)
    tables = (t.q_rows, t.suffix_indptr, t.suffix_indices)
    if mid_out.shape[2] == split + 1:
        # One suffix split: it merges the prefix partials itself (no merge kernel), and
        # runs beside the prefix kernel's last programs until it needs their partials.
        decode_merged(
            *suffix,
            out,
            *tables,
            mid_out[:, :, :split],
            mid_lse[:, :, :split],
            scale,
            overlap_writer=True,
            kv_scale=kv_scale,
        )
        return out
    decode_partials(
        *suffix, *tables, mid_out[:, :, split:], mid_lse[:, :, split:], scale, kv_scale=kv_scale
    )
    merge_splits(mid_out, mid_lse, out)
    return out


class CascadeDecode:
    """The cascade rows of one eager pass (`batch.cascade_rows`: all of a decode batch,
    the leading decoding requests of a mixed one), planned at construction (the tiles
    and the scratch at the first layer, when the head shape is known), run per layer."""

    def __init__(self, batch: ForwardBatch) -> None:
        if not batch.shared_prefixes:
            raise ValueError("cascade decode runs batches with shared prefixes")
        bs = batch.cascade_rows
        device = batch.req_to_token.device
        prefix_of = [0] * bs
        members: list[int] = []
        member_indptr = [0]
        leaders: list[int] = []
        lengths: list[int] = []
        for group in batch.shared_prefixes:
            for i in group.members:
                if i >= bs or prefix_of[i] or group.length >= batch.seq_lens_cpu[i]:
                    raise ValueError(
                        f"request {i}: not a leading one-token request, in two groups, "
                        "or no KV past its prefix"
                    )
                prefix_of[i] = group.length
            members.extend(group.members)
            member_indptr.append(len(members))
            leaders.append(group.members[0])
            lengths.append(group.length)
        self.rows = bs
        suffix_lens = [n - p for n, p in zip(batch.seq_lens_cpu[:bs], prefix_of, strict=True)]
        req_rows = batch.req_pool_indices[:bs]
        num_groups = len(lengths)
        packed = upload_int64(members + leaders + lengths + prefix_of + suffix_lens, device)
        cut = [len(members), num_groups, num_groups, bs, bs]
        members_t, leaders_t, lengths_t, prefix_t, suffix_t = packed.split(cut)
        # Any member's row holds the group's prefix slots.
        prefix_indptr, prefix_indices = build_kv_indices(
            batch.req_to_token, req_rows[leaders_t], lengths_t, sum(lengths)
        )
        suffix_indptr, suffix_indices = build_kv_indices(
            batch.req_to_token, req_rows, suffix_t, sum(suffix_lens), prefix_t
        )
        self._member_indptr = member_indptr
        self._max_prefix = max(lengths)
        self._max_suffix = max(suffix_lens)
        self._tables = _Tables(
            members=members_t,
            tiles=members_t,  # replaced by the real tiles at the first layer
            prefix_indptr=prefix_indptr,
            prefix_indices=prefix_indices,
            suffix_indptr=suffix_indptr,
            suffix_indices=suffix_indices,
            q_rows=batch.extend_start_loc[:bs],  # arange: request r's token is row r
        )
        self._scratch: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(
        self,
        q: torch.Tensor,  # [rows, num_heads, head_dim]: the cascade rows' tokens
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # where to write [rows, num_heads, head_dim]
        kv_scale: KVScale = UNIT_SCALE,
    ) -> torch.Tensor:
        mid_out, mid_lse, prefix_splits = self.prepare(q, k_buffer.shape[1])
        return _attend(
            self._tables, q, k_buffer, v_buffer, scale, mid_out, mid_lse, prefix_splits, out,
            kv_scale,
        )  # fmt: skip

    def prepare(self, q: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The pass's tiles and scratch, made at the first layer (on the current stream:
        a caller that runs `forward` on a side stream calls this first)."""
        if self._scratch is None:
            self._scratch = self._first_layer(q, num_kv_heads)
        return self._scratch

    def _first_layer(
        self, q: torch.Tensor, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Tiles and scratch, once the head shape is known. Unwritten splits read as
        -inf: every layer writes the same ones, so one fill serves the pass."""
        bs, num_heads, head_dim = q.shape
        tiles = prefix_tiles(self._member_indptr, members_per_tile(num_heads // num_kv_heads))
        self._tables.tiles = upload(torch.tensor(tiles, dtype=torch.int64), q.device)
        prefix_splits = _prefix_splits(len(tiles[0]) * num_kv_heads, q.device, self._max_prefix)
        # As few suffix splits as fill the GPU: a large batch (a mixed step's ~500
        # decoders) takes one, folding the prefix partials in with no merge kernel.
        suffix_splits = min(
            num_kv_splits(self._max_suffix),
            graph_num_kv_splits(bs, num_kv_heads, num_sms(q.device)),
        )
        splits = prefix_splits + suffix_splits
        mid_out = torch.empty(
            (bs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.full(
            (bs, num_heads, splits), float("-inf"), dtype=torch.float32, device=q.device
        )
        return mid_out, mid_lse, prefix_splits


class CascadeGraph:
    """The fixed tables and scratch of cascade passes captured in CUDA graphs of up to
    `max_bs` requests; one per attention backend."""

    def __init__(
        self,
        max_bs: int,
        max_context_len: int,
        suffix_indices: torch.Tensor,  # int32, >= max_bs * max_context_len entries:
        # the plain decode graphs' table, shared (a pass uses one or the other)
        device: torch.device,
    ) -> None:
        if suffix_indices.numel() < max_bs * max_context_len:
            raise ValueError("the suffix table must hold max_bs full contexts")
        self.max_bs = max_bs
        self.device = device
        self.max_groups = max_groups(max_bs)
        # Tiles of one member each at the most (a group of more than 2 fills fewer).
        self.max_tiles = max_bs + self.max_groups
        # One int64 buffer, written in one copy before each replay:
        # [prefix length per request | members | group lengths | group leaders | tiles x 3]
        # (a group's leader is a member's batch index: its request row holds the prefix).
        sizes = (max_bs, max_bs, self.max_groups, self.max_groups, 3 * self.max_tiles)
        self.tables = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        views = self.tables.split(sizes)
        self.prefix_of, self.members, self.group_lens, self.group_leaders = views[:4]
        self.tiles = views[4].view(3, self.max_tiles)
        self.prefix_indptr = torch.zeros(self.max_groups + 1, dtype=torch.int32, device=device)
        self.prefix_indices = torch.zeros(
            self.max_groups * max_context_len, dtype=torch.int32, device=device
        )
        self.suffix_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.suffix_indices = suffix_indices
        self.q_rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.per_tile: int | None = None  # members per tile, known at the first layer
        # Scratch buffers, kept while the graphs that hold their addresses live.
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- before a replay (host) ----------------------------------------------------
    def write(self, batch: ForwardBatch, num_real: int) -> None:
        """The groups of `batch` (a graph's static batch, its first `num_real` rows real,
        with the step's `shared_prefixes`) into the fixed tables: one copy, no sync."""
        if self.per_tile is None:
            raise RuntimeError("a cascade graph is replayed only after it was captured")
        bs = batch.batch_size
        groups = _keep(batch.shared_prefixes, max_groups(bs))
        prefix_of = [0] * self.max_bs
        members: list[int] = []
        indptr = [0]
        for group in groups:
            for i in group.members:
                if i >= num_real or prefix_of[i] or group.length >= batch.seq_lens_cpu[i]:
                    raise ValueError(
                        f"request {i}: padding, in two groups, or no KV past its prefix"
                    )
                prefix_of[i] = group.length
            members.extend(group.members)
            indptr.append(len(members))
        tiles = prefix_tiles(indptr, self.per_tile)
        num_tiles = len(tiles[0])
        assert num_tiles <= triton.cdiv(bs, self.per_tile) + max_groups(bs)
        pad_groups = [0] * (self.max_groups - len(groups))
        pad_tiles = [0] * (self.max_tiles - num_tiles)
        values = [
            *prefix_of,
            *members,
            *[0] * (self.max_bs - len(members)),
            *[g.length for g in groups],
            *pad_groups,
            *[g.members[0] for g in groups],
            *pad_groups,
            *tiles[0],
            *pad_tiles,
            *tiles[1],
            *pad_tiles,
            *tiles[2],
            *pad_tiles,
        ]
        upload_into(self.tables, torch.tensor(values, dtype=torch.int64))

    # -- capture (device work recorded in the graph) -------------------------------
    def capture(self, batch: ForwardBatch) -> CascadeGraphPass:
        """A cascade pass over the graph runner's static batch: the slot tables built on
        the device from the fixed buffers, as the graph will at every replay; the suffix
        splits are the plain decode graph's of this size."""
        bs = batch.batch_size
        if batch.mode != ForwardMode.DECODE or bs > self.max_bs:
            raise ValueError(f"cascade graphs run decode batches of up to {self.max_bs} requests")
        groups = max_groups(bs)
        prefix_of = self.prefix_of[:bs]
        gather_kv_rows(
            batch.req_to_token,
            batch.req_pool_indices[self.group_leaders[:groups]],
            self.group_lens[:groups],
            self.prefix_indptr[: groups + 1],
            self.prefix_indices,
        )
        gather_kv_rows(
            batch.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens - prefix_of,
            self.suffix_indptr[: bs + 1],
            self.suffix_indices,
            starts=prefix_of,
        )
        tables = _Tables(
            members=self.members,
            tiles=self.tiles,  # cut to this size's grid at the first layer
            prefix_indptr=self.prefix_indptr[: groups + 1],
            prefix_indices=self.prefix_indices,
            suffix_indptr=self.suffix_indptr[: bs + 1],
            suffix_indices=self.suffix_indices,
            q_rows=self.q_rows[:bs],
        )
        num_kv_heads = batch.kv_pool.k_buffers[0].shape[1]
        suffix_splits = graph_num_kv_splits(bs, num_kv_heads, num_sms(self.device))
        return CascadeGraphPass(self, tables, suffix_splits)

    def scratch(
        self, bs: int, num_heads: int, splits: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Split scratch views for a graph of `bs` requests. Graphs are captured largest
        first into shared buffers; a size that needs more gets a new buffer (the old ones
        stay: captured graphs hold their addresses)."""
        numel = bs * num_heads * splits
        if not self._scratch or self._scratch[-1][1].numel() < numel:
            self._scratch.append(
                (
                    torch.empty(numel * head_dim, dtype=torch.float32, device=self.device),
                    torch.empty(numel, dtype=torch.float32, device=self.device),
                )
            )
        mid_out, mid_lse = self._scratch[-1]
        return (
            mid_out[: numel * head_dim].view(bs, num_heads, splits, head_dim),
            mid_lse[:numel].view(bs, num_heads, splits),
        )


class CascadeGraphPass:
    """A cascade pass of one graph size (captured, or its warm-up): every layer's
    attention over the tables `CascadeGraph.capture` queued."""

    def __init__(self, graph: CascadeGraph, tables: _Tables, suffix_splits: int) -> None:
        self._graph = graph
        self._tables = tables
        self._suffix_splits = suffix_splits
        self._scratch: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        scale: float,
        kv_scale: KVScale = UNIT_SCALE,
    ) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = self._first_layer(q, k_buffer.shape[1])
        mid_out, mid_lse, prefix_splits = self._scratch
        return _attend(
            self._tables, q, k_buffer, v_buffer, scale, mid_out, mid_lse, prefix_splits,
            kv_scale=kv_scale,
        )  # fmt: skip

    def _first_layer(
        self, q: torch.Tensor, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The fixed grid (enough tiles for max_groups of this size), the split counts
        and the scratch, whose -inf fill runs once per pass (every layer writes the same
        splits)."""
        graph = self._graph
        bs, num_heads, head_dim = q.shape
        per_tile = members_per_tile(num_heads // num_kv_heads)
        if graph.per_tile not in (None, per_tile):
            raise RuntimeError("cascade graphs were captured for another head layout")
        graph.per_tile = per_tile
        full_tiles = triton.cdiv(bs, per_tile)
        self._tables.tiles = graph.tiles[:, : full_tiles + max_groups(bs)]
        # Sized for the usual layout: groups filling whole tiles.
        prefix_splits = _prefix_splits(full_tiles * num_kv_heads, q.device)
        mid_out, mid_lse = graph.scratch(
            bs, num_heads, prefix_splits + self._suffix_splits, head_dim
        )
        mid_lse.fill_(float("-inf"))
        return mid_out, mid_lse, prefix_splits


def _keep(groups: tuple[SharedPrefix, ...], limit: int) -> list[SharedPrefix]:
    """The `limit` groups that save the most KV reads ((members - 1) x prefix length)."""
    if len(groups) <= limit:
        return list(groups)
    return sorted(groups, key=lambda g: (len(g.members) - 1) * g.length, reverse=True)[:limit]


# What a backend runs a cascade step's layers with.
CascadePass = CascadeDecode | CascadeGraphPass
