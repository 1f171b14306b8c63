"""Decode attention alone over shared prefixes: plain split-KV against cascade.

One layer of Llama-3.1-8B's attention (32 query heads, 8 KV heads, head dim 128,
bf16) for a decode batch of `groups` x `members` requests, each over a `prefix`-token
prefix shared by its group plus `suffix` tokens of its own (the generated-shared-prefix
workload mid-decode: 2048 + 128 question + generated tokens). Backends run the same
batch: triton and flashinfer (when installed) read every request's whole KV; cascade
(the triton backend given the batch's `shared_prefixes`) reads each prefix once.
Median of CUDA-event timings; bytes are the KV each one must read at the least.

    python lab/probes/cascade_attention.py [--groups 16 --members 16 --prefix 2048 --suffix 256]

With --sweep it times the cascade's two kernels alone over their launch options (the
prefix kernel also over its split count; the suffix kernel at one split, folding the
prefix partials in), median of CUDA-event timings of 20 launches each, best first.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
from collections.abc import Callable
from dataclasses import replace

import torch

from radixserve.engine.attention.cascade import CascadeDecode
from radixserve.engine.attention.triton_ops.decode import (
    LaunchOptions,
    decode_merged,
    launch_options,
)
from radixserve.engine.attention.triton_ops.shared_prefix import (
    PREFIX_OPTIONS,
    shared_prefix_attention,
)
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode, SharedPrefix
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def build(groups: int, members: int, prefix: int, suffix: int) -> tuple[ForwardBatch, torch.Tensor]:
    device = torch.device("cuda")
    bs = groups * members
    seq = prefix + suffix
    pool = KVPool(groups * prefix + bs * suffix + 16, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.normal_()
    req_pool = ReqToTokenPool(bs + 1, seq + 8, device)
    rows = []
    for _ in range(groups):
        shared = pool.alloc(prefix)
        assert shared is not None
        for _ in range(members):
            row = req_pool.alloc()
            own = pool.alloc(suffix)
            assert row is not None and own is not None
            req_pool.req_to_token[row, :seq] = torch.cat([shared, own]).to(torch.int32)
            rows.append(row)
    # Members of a group are scattered through the batch, as the scheduler's order has them.
    order = torch.randperm(bs, generator=torch.Generator().manual_seed(0)).tolist()
    rows = [rows[i] for i in order]
    where = {orig: pos for pos, orig in enumerate(order)}

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    new_loc = req_pool.req_to_token[ints(rows), seq - 1].to(torch.int64)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=ints([0] * bs),
        positions=ints([seq - 1] * bs),
        out_cache_loc=new_loc,
        req_pool_indices=ints(rows),
        seq_lens=ints([seq] * bs),
        extend_prefix_lens=ints([seq - 1] * bs),
        extend_seq_lens=ints([1] * bs),
        extend_start_loc=ints(list(range(bs))),
        req_to_token=req_pool.req_to_token,
        kv_pool=pool,
        seq_lens_cpu=[seq] * bs,
        extend_prefix_lens_cpu=[seq - 1] * bs,
        extend_seq_lens_cpu=[1] * bs,
        shared_prefixes=tuple(
            SharedPrefix(prefix, tuple(where[g * members + m] for m in range(members)))
            for g in range(groups)
        ),
    )
    q = torch.randn(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    return batch, q


def time_ms(
    backend: object, batch: ForwardBatch, q: torch.Tensor, iters: int
) -> tuple[float, float]:
    """(median ms of one layer's attention, ms of the per-pass metadata on the stream)."""
    k = torch.randn(q.shape[0], KV_HEADS, HEAD_DIM, dtype=q.dtype, device=q.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    plan = []
    layer = []
    for _ in range(iters):
        start.record()
        backend.init_forward_metadata(batch)  # type: ignore[attr-defined]
        end.record()
        end.synchronize()
        plan.append(start.elapsed_time(end))
        # The first layer of a pass may plan (flashinfer): time a later one.
        backend.forward(q, k, k, 0, batch, HEAD_DIM**-0.5)  # type: ignore[attr-defined]
        start.record()
        backend.forward(q, k, k, 0, batch, HEAD_DIM**-0.5)  # type: ignore[attr-defined]
        end.record()
        end.synchronize()
        layer.append(start.elapsed_time(end))
    return statistics.median(layer[2:]), statistics.median(plan[2:])


def _time_launches(launch: Callable[[], None], iters: int = 20) -> float:
    """Median ms of one launch, from `iters` back-to-back launches timed 5 times."""
    launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _time_option(label: str, launch: Callable[[], None]) -> float | None:
    """Median ms of `launch`, or None (said) where the compiler refuses its options."""
    try:
        return _time_launches(launch)
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}")
        return None


def sweep(groups: int, members: int, prefix: int, suffix: int) -> None:
    """The prefix and suffix kernels of one cascade layer over their launch options."""
    batch, q = build(groups, members, prefix, suffix)
    cascade = CascadeDecode(batch)
    cascade.forward(q, batch.kv_pool.k_buffers[0], batch.kv_pool.v_buffers[0], 1.0)  # tiles
    t = cascade._tables  # the pass's device tables (private: a bench reaches in)
    kb, vb = batch.kv_pool.k_buffers[0], batch.kv_pool.v_buffers[0]
    bs = batch.batch_size
    kv_bytes = 2 * KV_HEADS * HEAD_DIM * 2
    prefix_gb = groups * prefix * kv_bytes / 1e9
    suffix_gb = bs * suffix * kv_bytes / 1e9
    rows = []
    for splits in (1, 2, 4, 8):
        mid_out = torch.empty((bs, HEADS, splits, HEAD_DIM), dtype=torch.float32, device=q.device)
        mid_lse = torch.full((bs, HEADS, splits), float("-inf"), device=q.device)
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            opts = LaunchOptions(block_n, warps, stages)
            prefix_pass = functools.partial(
                shared_prefix_attention,
                *(q, kb, vb, t.members, t.tiles, t.prefix_indptr, t.prefix_indices),
                *(mid_out, mid_lse, HEAD_DIM**-0.5),
                options=opts,
            )
            name = f"prefix splits {splits} {opts}"
            if (ms := _time_option(name, prefix_pass)) is not None:
                rows.append((ms, name, prefix_gb / ms * 1e3))
    merged_out = torch.empty((bs, HEADS, 2, HEAD_DIM), dtype=torch.float32, device=q.device)
    merged_lse = torch.full((bs, HEADS, 2), float("-inf"), device=q.device)
    out = torch.empty_like(q)
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4), (1, 2, 3, 4)):
        opts = LaunchOptions(block_n, warps, stages)
        suffix_pass = functools.partial(
            decode_merged,
            *(q, kb, vb, out, t.q_rows, t.suffix_indptr, t.suffix_indices),
            *(merged_out, merged_lse, HEAD_DIM**-0.5),
            options=opts,
        )
        name = f"suffix merged {opts}"
        if (ms := _time_option(name, suffix_pass)) is not None:
            rows.append((ms, name, suffix_gb / ms * 1e3))
    print(
        f"bs {bs}, {groups} groups over {prefix} + {suffix}: prefix {prefix_gb:.3f} GB, suffix {suffix_gb:.3f} GB"
    )
    for kind, default in (("prefix", PREFIX_OPTIONS), ("suffix", launch_options(1, 0, 0))):
        best = sorted(r for r in rows if r[1].startswith(kind))
        for ms, name, gbs in best[:8]:
            print(f"{ms:8.4f} ms {gbs:7.0f} GB/s  {name}")
        for ms, name, gbs in best:
            if name.endswith(str(default)):
                print(f"  (default) {ms:8.4f} ms {gbs:7.0f} GB/s  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, nargs="+", default=[128, 256, 384])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="launch options of the two kernels")
    args = ap.parse_args()
    if args.sweep:
        for suffix in args.suffix:
            sweep(args.groups, args.members, args.prefix, suffix)
        return
    from radixserve.engine.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda")
    backends: dict[str, object] = {"triton": TritonAttentionBackend(device)}
    try:
        from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        backends["flashinfer"] = FlashInferAttentionBackend(device, torch.bfloat16)
    except RuntimeError as exc:
        print(f"flashinfer: {exc}")
    kv_bytes = 2 * KV_HEADS * HEAD_DIM * 2  # one token's K and V in one layer
    print(f"{'suffix':>6} {'run':>18} {'layer ms':>9} {'plan ms':>8} {'min GB':>7} {'GB/s':>6}")
    for suffix in args.suffix:
        batch, q = build(args.groups, args.members, args.prefix, suffix)
        bs = batch.batch_size
        plain = replace(batch, shared_prefixes=())
        whole = bs * (args.prefix + suffix) * kv_bytes / 1e9
        once = (args.groups * args.prefix + bs * suffix) * kv_bytes / 1e9
        runs = [(name, b, plain, whole) for name, b in backends.items()]
        runs += [(f"{name}+cascade", b, batch, once) for name, b in backends.items()]
        for name, backend, b, gb in runs:
            ms, plan_ms = time_ms(backend, b, q, args.iters)
            print(f"{suffix:>6} {name:>18} {ms:9.3f} {plan_ms:8.3f} {gb:7.3f} {gb / ms * 1e3:6.0f}")


if __name__ == "__main__":
    main()
