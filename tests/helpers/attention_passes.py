"""Attention backend test inputs: one forward pass over a noisy, shuffled paged pool,
and the comparison of a backend with the torch reference on it.

Shared by the CPU (Triton interpreter) and the CUDA attention tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.engine.attention.base import AttentionBackend, LayerAttention
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode, SharedPrefix
from radixserve.engine.kvcache.fp8 import KVScale
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool


@dataclass
class Pass:
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


def make_pass(
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    device: torch.device,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 16,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    mode: ForwardMode = ForwardMode.EXTEND,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: Sequence[KVScale] | None = None,
) -> Pass:
    """Requests lay their KV page by page over a shuffled free list, as the scheduler's
    would after churn; every slot of every layer holds noise, so reading the wrong
    slot, layer or padding shows up, and the cached prefixes are the noise at their
    slots. `kv_dtype`: the pool's, where not `dtype` (FP8: the noise is the codes, and
    `kv_scales` the two layers' scales)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_needed = sum(-(-n // page_size) for n in seq_lens)
    pool = KVPool(
        (pages_needed + 8) * page_size,
        2,
        kv_heads,
        head_dim,
        kv_dtype or dtype,
        device,
        page_size=page_size,
    )
    if kv_scales is not None:
        pool.set_scales(list(kv_scales))
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen, device=device))
    held = pool.alloc(pool.available())
    assert held is not None
    pages = held.view(-1, page_size)
    order = torch.randperm(pages.shape[0], generator=gen, device=device)
    pool.free(pages[order].reshape(-1))

    req_pool = ReqToTokenPool(len(seq_lens) + 2, max(seq_lens) + 8, device)
    rows, new_slots = [], []
    for prefix, seq in zip(prefix_lens, seq_lens, strict=True):
        row = req_pool.alloc()
        slots = pool.alloc(-(-seq // page_size) * page_size)
        assert row is not None and slots is not None
        req_pool.req_to_token[row, :seq] = slots[:seq].to(torch.int32)
        rows.append(row)
        new_slots.append(slots[prefix:seq])

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    num_tokens = sum(extend_lens)
    positions = [p + i for p, e in zip(prefix_lens, extend_lens, strict=True) for i in range(e)]
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=ints(positions),
        out_cache_loc=torch.cat(new_slots),
        req_pool_indices=ints(rows),
        seq_lens=ints(seq_lens),
        extend_prefix_lens=ints(prefix_lens),
        extend_seq_lens=ints(extend_lens),
        extend_start_loc=ints([sum(extend_lens[:i]) for i in range(len(extend_lens))]),
        req_to_token=req_pool.req_to_token,
        kv_pool=pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
    )
    # q/k/v as the model hands them over: strided views of one fused projection.
    width = (heads + 2 * kv_heads) * head_dim
    fused = torch.randn(num_tokens, width, generator=gen, device=device).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return Pass(
        batch,
        q.reshape(num_tokens, heads, head_dim),
        k.reshape(num_tokens, kv_heads, head_dim),
        v.reshape(num_tokens, kv_heads, head_dim),
        scale=1.3 / head_dim**0.5,  # not the default, so a backend ignoring `scale` fails
    )


def float32_twin(p: Pass, twin: Pass) -> Pass:
    """`twin` (the same make_pass arguments as `p`, in float32: the same noise at the
    same slots, unrounded) holding `p`'s half-precision values exactly, so a reference
    run on it has no rounding of its own."""
    for mine, theirs in zip(
        twin.batch.kv_pool.k_buffers + twin.batch.kv_pool.v_buffers,
        p.batch.kv_pool.k_buffers + p.batch.kv_pool.v_buffers,
        strict=True,
    ):
        mine.copy_(theirs.float())
    return Pass(twin.batch, p.q.float(), p.k.float(), p.v.float(), p.scale)


def compare_with_torch(
    p: Pass,
    backend: AttentionBackend,
    layers: tuple[int, ...] = (1,),
    attention: Sequence[LayerAttention] = (),
    exact: Pass | None = None,
) -> float:
    """`backend` and the torch reference on the same pass; asserts equal pool writes and
    returns the worst output error relative to the reference's largest value. The new
    tokens' slots are re-noised before `backend` runs, so it must write them itself,
    and every other slot must come out untouched. One init_forward_metadata is shared
    by the layers, as in the model. `attention`: each layer's window and soft-cap, set
    on both backends. `exact` (a `float32_twin` of `p`): the outputs are measured
    against the reference run on it instead, for half-precision passes whose torch
    reference rounds its scores (soft-capped ones: before the tanh)."""
    pool = p.batch.kv_pool
    reference = TorchAttentionBackend()
    reference.set_layers(attention)
    backend.set_layers(attention)
    exact_refs = []
    if exact is not None:
        reference.init_forward_metadata(exact.batch)
        exact_refs = [
            reference.forward(exact.q, exact.k, exact.v, layer, exact.batch, exact.scale)
            for layer in layers
        ]
    reference.init_forward_metadata(p.batch)
    refs = [reference.forward(p.q, p.k, p.v, layer, p.batch, p.scale) for layer in layers]
    expected = [(k.clone(), v.clone()) for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True)]
    noise = torch.randn(p.k.shape, generator=torch.Generator().manual_seed(99)).to(p.k.device)
    for layer in layers:
        pool.set_kv(layer, p.batch.out_cache_loc, noise, -noise)

    backend.init_forward_metadata(p.batch)
    worst = 0.0
    for i, (layer, ref) in enumerate(zip(layers, refs, strict=True)):
        out = backend.forward(p.q, p.k, p.v, layer, p.batch, p.scale)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.isfinite(out).all()
        if exact is not None:
            ref = exact_refs[i]
        error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        worst = max(worst, float(error))
    for i, (k_expected, v_expected) in enumerate(expected):
        assert torch.equal(pool.k_buffers[i], k_expected), f"layer {i} K differs"
        assert torch.equal(pool.v_buffers[i], v_expected), f"layer {i} V differs"
    return worst


def share_prefixes(p: Pass, groups: list[tuple[int, list[int]]]) -> None:
    """Make each group's members (batch indices) share the first `length` slots of the
    first member's row, as requests on one radix path do, and name the groups in the
    batch. The torch reference reads the rows as they are, so it is the reference."""
    batch = p.batch
    table = batch.req_to_token
    for length, members in groups:
        leader = int(batch.req_pool_indices[members[0]])
        for i in members[1:]:
            assert batch.seq_lens_cpu[i] > length
            table[int(batch.req_pool_indices[i]), :length] = table[leader, :length]
    batch.shared_prefixes = tuple(SharedPrefix(n, tuple(m)) for n, m in groups)
