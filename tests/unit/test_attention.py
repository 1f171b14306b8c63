"""The torch attention backend against a naive per-request softmax(QK^T)V reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from tests.helpers.batches import PagedRequests

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]
HEAD_DIM = 16
LAYER = 1  # not layer 0, so a backend that ignores layer_id fails


@dataclass
class Case:
    """Random K/V for whole sequences and Q for the new tokens of each request."""

    prefix_lens: list[int]
    extend_lens: list[int]
    q: list[torch.Tensor]  # per request [extend, heads, d]
    k: list[torch.Tensor]  # per request [prefix + extend, kv_heads, d]
    v: list[torch.Tensor]


def make_case(
    prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int, seed: int
) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    return Case(
        prefix_lens,
        extend_lens,
        q=[rand(e, heads, HEAD_DIM) for e in extend_lens],
        k=[rand(n, kv_heads, HEAD_DIM) for n in seq],
        v=[rand(n, kv_heads, HEAD_DIM) for n in seq],
    )


def naive_attention(case: Case, scale: float) -> torch.Tensor:
    """Explicit softmax(QK^T)V per request; new token i sees keys j <= prefix + i."""
    outs = []
    for q, k, v, prefix in zip(case.q, case.k, case.v, case.prefix_lens, strict=True):
        group = q.shape[1] // k.shape[1]
        k_full = k.repeat_interleave(group, dim=1).double()  # [n, heads, d]
        v_full = v.repeat_interleave(group, dim=1).double()
        scores = torch.einsum("qhd,khd->hqk", q.double(), k_full) * scale
        rows = torch.arange(q.shape[0])[:, None]
        cols = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(cols > prefix + rows, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_full))
    return torch.cat(outs).float()


def run_backend(
    case: Case, mode: ForwardMode, device: str, dtype: torch.dtype, fragment: bool = True
) -> tuple[torch.Tensor, ForwardBatch]:
    kv_heads = case.k[0].shape[1]
    pool = KVPool(
        512, num_layers=2, num_kv_heads=kv_heads, head_dim=HEAD_DIM, dtype=dtype, device=device
    )
    if fragment:
        # Scatter requests' slots over the pool, so a backend assuming contiguous KV fails.
        held = pool.alloc(pool.available())
        assert held is not None
        pool.free(held[torch.randperm(held.numel(), generator=torch.Generator().manual_seed(0))])
    reqs = PagedRequests(pool, ReqToTokenPool(16, 256, device))
    rows = [reqs.new_request() for _ in case.prefix_lens]
    cached = [(r, [0] * p) for r, p in zip(rows, case.prefix_lens, strict=True) if p > 0]
    if cached:
        # The cached prefix's K/V, as an earlier pass would have left it.
        prefill = reqs.build(ForwardMode.EXTEND, cached)
        k_prefix = torch.cat([k[:p] for k, p in zip(case.k, case.prefix_lens, strict=True)])
        v_prefix = torch.cat([v[:p] for v, p in zip(case.v, case.prefix_lens, strict=True)])
        pool.set_kv(LAYER, prefill.out_cache_loc, k_prefix.to(device), v_prefix.to(device))
    new = [(r, [0] * e) for r, e in zip(rows, case.extend_lens, strict=True)]
    batch = reqs.build(mode, new)
    k_new = torch.cat([k[p:] for k, p in zip(case.k, case.prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(case.v, case.prefix_lens, strict=True)])
    q = torch.cat(case.q)
    backend = TorchAttentionBackend()
    backend.init_forward_metadata(batch)
    scale = HEAD_DIM**-0.5
    out = backend.forward(
        q.to(device, dtype), k_new.to(device, dtype), v_new.to(device, dtype), LAYER, batch, scale
    )
    return out, batch


CASES = {
    "extend_no_prefix": ([0, 0, 0], [5, 1, 12]),
    "extend_mixed_prefix": ([0, 7, 3, 20], [4, 9, 1, 2]),
    "extend_all_prefixed": ([2, 30], [6, 3]),
    "extend_all_single": ([4, 0, 9], [1, 1, 1]),  # an EXTEND batch of decode-like requests
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("name", list(CASES))
def test_extend_matches_naive(name: str, heads: int, kv_heads: int, device: str) -> None:
    prefix_lens, extend_lens = CASES[name]
    case = make_case(prefix_lens, extend_lens, heads, kv_heads, seed=len(name))
    out, _ = run_backend(case, ForwardMode.EXTEND, device, torch.float32)
    torch.testing.assert_close(
        out.cpu(), naive_attention(case, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix_lens", [[3, 17, 0, 40], [9, 9, 9]], ids=["ragged", "equal"])
def test_decode_matches_naive(prefix_lens: list[int], device: str) -> None:
    case = make_case(prefix_lens, [1] * len(prefix_lens), heads=6, kv_heads=2, seed=3)
    out, _ = run_backend(case, ForwardMode.DECODE, device, torch.float32)
    torch.testing.assert_close(
        out.cpu(), naive_attention(case, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
def test_new_kv_is_written_to_the_pool(device: str) -> None:
    case = make_case([5, 0], [3, 4], heads=4, kv_heads=2, seed=7)
    _, batch = run_backend(case, ForwardMode.EXTEND, device, torch.float32)
    k_new = torch.cat([k[p:] for k, p in zip(case.k, case.prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(case.v, case.prefix_lens, strict=True)])
    torch.testing.assert_close(batch.kv_pool.k_buffers[LAYER][batch.out_cache_loc].cpu(), k_new)
    torch.testing.assert_close(batch.kv_pool.v_buffers[LAYER][batch.out_cache_loc].cpu(), v_new)
    # Other layers untouched, the reserved padding slot still zero.
    assert not batch.kv_pool.k_buffers[0].any()
    assert not batch.kv_pool.k_buffers[LAYER][0].any()


def test_bfloat16_close_to_naive() -> None:
    case = make_case([0, 6], [10, 1], heads=4, kv_heads=2, seed=11)
    out, _ = run_backend(case, ForwardMode.EXTEND, "cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), naive_attention(case, HEAD_DIM**-0.5), atol=3e-2, rtol=3e-2
    )


def test_long_prompt_beside_decodes_has_no_nan() -> None:
    # A mixed batch: one long prefill among short decodes (the padded path must not NaN).
    case = make_case([0, 50, 1, 120], [64, 1, 1, 1], heads=4, kv_heads=1, seed=5)
    out, _ = run_backend(case, ForwardMode.EXTEND, "cpu", torch.float32, fragment=False)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive_attention(case, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5)


def test_inconsistent_batch_is_rejected() -> None:
    case = make_case([2], [3], heads=2, kv_heads=1, seed=0)
    _, batch = run_backend(case, ForwardMode.EXTEND, "cpu", torch.float32)
    batch.seq_lens_cpu = [4]  # prefix 2 + 3 new would be 5
    with pytest.raises(ValueError, match="seq_len"):
        TorchAttentionBackend().init_forward_metadata(batch)


def test_decode_batch_with_several_new_tokens_is_rejected() -> None:
    case = make_case([2, 0], [1, 2], heads=2, kv_heads=1, seed=0)
    with pytest.raises(ValueError, match="DECODE"):
        run_backend(case, ForwardMode.DECODE, "cpu", torch.float32)
