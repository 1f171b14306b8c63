"""Reference attention over the paged KV pool in plain PyTorch (CPU and CUDA).

Per batch, requests are split into a decode group (one new token each) and an
extend group (several), so a long prefill chunk does not pad every decode request
of a mixed batch to its length. Per group, `init_forward_metadata` builds once:
a padded [bs, max_kv] table of KV slots (padding -> reserved slot 0), the boolean
mask, and for extend the positions of the new tokens in a padded [bs, max_q]
query grid. Each layer then gathers K/V, runs one scaled_dot_product_attention
and unpads.

GQA without repeating K/V: the G query heads that share a KV head are folded
into the query-length axis ([bs, kv_heads, G * q_len, d]), which every torch
version's SDPA supports.

An FP8 pool's gathered codes are widened to q's dtype by the layer's scales
(kvcache/fp8.widen), so this is the reference for the kernels on FP8 pools too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radixserve.engine.attention.base import AttentionBackend, LayerAttention, check_batch
from radixserve.engine.kvcache.fp8 import KVScale, widen

if TYPE_CHECKING:
    from radixserve.engine.forward_batch import ForwardBatch

# cuDNN attention is left out: it builds a plan per shape, and the KV length changes
# every decode step, which made bf16 decode on an H100 4x slower than float32.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _Group:
    """Requests attended together, with their padded index tables."""

    # Flat token rows of this group's new tokens; None when the group is the whole batch.
    token_index: torch.Tensor | None
    kv_index: torch.Tensor  # [bs, max_kv] int64 slots, padding -> 0
    # [bs, 1, q_len, max_kv] bool, True = attend; None when nothing is masked.
    mask: torch.Tensor | None
    max_q: int  # 1 for a decode group
    # Extend only: row of each new token in the flattened [bs * max_q] query grid.
    pad_index: torch.Tensor | None
    # [bs, max_q] position of each query row (padding rows: past their request's last).
    query_pos: torch.Tensor
    # [bs, max_q] whether a query row is a real token (padding rows are dropped).
    real_rows: torch.Tensor
    # (window, G) -> the mask with the window applied, repeated for G folded query heads,
    # built on first use per pass.
    folded_masks: dict[tuple[int | None, int], torch.Tensor | None] = field(default_factory=dict)

    def folded_mask(self, window: int | None, group_size: int) -> torch.Tensor | None:
        key = (window, group_size)
        if key not in self.folded_masks:
            mask = self.mask if window is None else self._window_mask(window)
            if mask is not None and self.max_q > 1:
                mask = mask.repeat(1, 1, group_size, 1)  # rows ordered (g, i), as q is folded
            self.folded_masks[key] = mask
        return self.folded_masks[key]

    def _window_mask(self, window: int) -> torch.Tensor:
        """The pass's mask, and key j visible to a query at p only if j > p - window."""
        cols = torch.arange(self.kv_index.shape[1], device=self.kv_index.device)
        inside = cols[None, None, :] > self.query_pos[:, :, None] - window
        base = self.mask if self.mask is not None else torch.ones_like(inside[:, None])
        mask = base & inside[:, None]
        # Padding rows keep key 0, so softmax never sees an all-masked row (no NaN).
        mask[..., 0] |= ~self.real_rows[:, None]
        return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_layer_attention = True

    def __init__(self) -> None:
        self._groups: list[_Group] = []
        # Gather targets reused by every layer and pass: on the CPU a fresh multi-MB
        # tensor per layer costs more in page faults than the gather itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        check_batch(batch)
        extend_lens = batch.extend_seq_lens_cpu
        decode = [i for i, ext in enumerate(extend_lens) if ext == 1]
        extend = [i for i, ext in enumerate(extend_lens) if ext > 1]
        if not extend:
            self._groups = [self._decode_group(batch, None)]
        elif not decode:
            self._groups = [self._extend_group(batch, None)]
        else:
            self._groups = [self._decode_group(batch, decode), self._extend_group(batch, extend)]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            batch.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buffer = batch.kv_pool.k_buffers[layer_id]
        v_buffer = batch.kv_pool.v_buffers[layer_id]
        layer = self.layer(layer_id)
        kv_scale = batch.kv_pool.scales[layer_id]
        if len(self._groups) == 1 and self._groups[0].token_index is None:
            return self._attend(self._groups[0], q, k_buffer, v_buffer, kv_scale, scale, layer)
        out = torch.empty_like(q)
        for group in self._groups:
            assert group.token_index is not None
            out[group.token_index] = self._attend(
                group, q[group.token_index], k_buffer, v_buffer, kv_scale, scale, layer
            )
        return out

    # -- per layer ------------------------------------------------------------------
    def _attend(
        self,
        group: _Group,
        q: torch.Tensor,  # [group tokens, heads, d]
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        kv_scale: KVScale,
        scale: float,
        layer: LayerAttention,
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_buffer.shape[1]
        group_size = num_heads // num_kv_heads
        bs, max_q = group.kv_index.shape[0], group.max_q
        # [bs, max_kv, kv_heads, d] -> [bs, kv_heads, max_kv, d]
        keys = widen(self._gather("k", k_buffer, group.kv_index), kv_scale.k, q.dtype)
        values = widen(self._gather("v", v_buffer, group.kv_index), kv_scale.v, q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if group.pad_index is None:  # decode: one query per request, no padding
            grid = q
        else:
            grid = q.new_zeros(bs * max_q, num_heads, head_dim)
            grid.index_copy_(0, group.pad_index, q)
        # [bs * max_q, H, d] -> [bs, kv_heads, G * max_q, d]; head h = kv_head * G + g.
        folded = (
            grid.reshape(bs, max_q, num_kv_heads, group_size, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(bs, num_kv_heads, group_size * max_q, head_dim)
        )
        mask = group.folded_mask(layer.window, group_size)
        if layer.soft_cap is None:
            with sdpa_kernel(_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(
                    folded, keys, values, attn_mask=mask, scale=scale
                )
        else:
            out = _soft_capped_attention(folded, keys, values, mask, scale, layer.soft_cap)
        out = (
            out.reshape(bs, num_kv_heads, group_size, max_q, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(bs * max_q, num_heads, head_dim)
        )
        return out if group.pad_index is None else out.index_select(0, group.pad_index)

    def _gather(self, key: str, buffer: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
        """buffer[kv_index] ([bs, max_kv, kv_heads, d]) written into a reused scratch tensor."""
        rows = kv_index.numel()
        row_shape = buffer.shape[1:]
        scratch = self._scratch.get(key)
        if (
            scratch is None
            or scratch.shape[0] < rows
            or scratch.shape[1:] != row_shape
            or scratch.dtype != buffer.dtype
            or scratch.device != buffer.device
        ):
            scratch = buffer.new_empty((rows, *row_shape))
            self._scratch[key] = scratch
        out = scratch[:rows]
        torch.index_select(buffer, 0, kv_index.reshape(-1), out=out)
        return out.view(*kv_index.shape, *row_shape)

    # -- per batch ------------------------------------------------------------------
    def _decode_group(self, batch: ForwardBatch, members: list[int] | None) -> _Group:
        seq_lens = _pick(batch.seq_lens_cpu, members)
        kv_index, valid = _kv_table(batch, members, seq_lens)
        # Equal lengths need no mask at all (the common steady-state case is cheaper).
        mask = None if min(seq_lens) == max(seq_lens) else valid[:, None, None, :]
        query_pos = torch.tensor(seq_lens, dtype=torch.int64, device=kv_index.device) - 1
        return _Group(
            token_index=_token_rows(batch, members),
            kv_index=kv_index,
            mask=mask,
            max_q=1,
            pad_index=None,
            query_pos=query_pos[:, None],
            real_rows=torch.ones_like(query_pos[:, None], dtype=torch.bool),
        )

    def _extend_group(self, batch: ForwardBatch, members: list[int] | None) -> _Group:
        device = batch.input_ids.device
        seq_lens = _pick(batch.seq_lens_cpu, members)
        prefix_lens = _pick(batch.extend_prefix_lens_cpu, members)
        extend_lens = _pick(batch.extend_seq_lens_cpu, members)
        kv_index, valid = _kv_table(batch, members, seq_lens)
        max_q, max_kv = max(extend_lens), max(seq_lens)
        prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
        rows = torch.arange(max_q, device=device)
        cols = torch.arange(max_kv, device=device)
        # Key j is visible to new token i of request b iff j < seq_len_b and j <= prefix_b + i.
        query_pos = prefix[:, None] + rows[None, :]
        causal = cols[None, None, :] <= query_pos[:, :, None]
        mask = (valid[:, None, :] & causal).unsqueeze(1)
        # Padded query rows see key 0 at least (they are dropped), so softmax never sees
        # an all-masked row and cannot produce NaN.
        mask[..., 0] = True
        lens = torch.tensor(extend_lens, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        local = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
        pad_index = torch.repeat_interleave(torch.arange(len(extend_lens)) * max_q, lens) + local
        return _Group(
            token_index=_token_rows(batch, members),
            kv_index=kv_index,
            mask=mask,
            max_q=max_q,
            pad_index=pad_index.to(device),
            query_pos=query_pos,
            real_rows=rows[None, :] < lens.to(device)[:, None],
        )


def _soft_capped_attention(
    q: torch.Tensor,  # [bs, kv_heads, rows, d]
    keys: torch.Tensor,  # [bs, kv_heads, max_kv, d]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # broadcast to [bs, kv_heads, rows, max_kv], True = attend
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """Attention with scores soft_cap * tanh(score / soft_cap), in transformers' eager op
    order (Gemma 2: SDPA has no cap): capped, masked, float32 softmax, then x values."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


def _pick(values: list[int], members: list[int] | None) -> list[int]:
    return values if members is None else [values[i] for i in members]


def _kv_table(
    batch: ForwardBatch, members: list[int] | None, seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """([bs, max_kv] int64 KV slots with padding -> 0, [bs, max_kv] validity)."""
    device = batch.input_ids.device
    rows = batch.req_pool_indices
    if members is not None:
        rows = rows[torch.tensor(members, dtype=torch.int64, device=rows.device)]
    max_kv = max(seq_lens)
    slots = batch.req_to_token[rows, :max_kv].to(torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    valid = torch.arange(max_kv, device=device)[None, :] < lens[:, None]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _token_rows(batch: ForwardBatch, members: list[int] | None) -> torch.Tensor | None:
    """Flat token rows of the members' new tokens (tokens are laid out in request order)."""
    if members is None:
        return None
    lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    picked = torch.tensor(members, dtype=torch.int64)
    picked_lens = lens[picked]
    local_starts = torch.cumsum(picked_lens, 0) - picked_lens
    local = torch.arange(int(picked_lens.sum())) - torch.repeat_interleave(
        local_starts, picked_lens
    )
    rows = torch.repeat_interleave(starts[picked], picked_lens) + local
    return rows.to(batch.input_ids.device)
