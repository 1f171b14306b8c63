"""Decode attention kernels alone: the Triton split-KV kernel's launch options swept.

One layer of Llama-3.1-8B's attention (32 query heads, 8 KV heads, head dim 128, bf16)
for a decode batch of `bs` requests over `context` tokens each, slots scattered in the
pool as a serving pool has them after some churn (runs of 16 slots in random order).
Every configuration runs inside a CUDA graph (as the engine's decode does), so launch
gaps count as they do there; each figure is the median over `--reps` replays of a graph
of 20 layers. "ms" is what the engine would run with those options: at one split the
one-pass kernel that writes the output itself, else both stages ("2-stage" times both
stages at one split too). "current" is the engine's own choice: the split count
`graph_num_kv_splits` picks and `launch_options` for it. FlashInfer's paged decode runs
beside it when installed. GB/s counts the KV each must read (K and V of every token once).

    python lab/probes/decode_attention.py [--batch-sizes 1 64 --context 528]
    python lab/probes/decode_attention.py --batch-sizes 1 --context 32768 --only 16,128,4,3
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from collections.abc import Callable

import torch

from radixserve.engine.attention.triton_ops.common import num_sms
from radixserve.engine.attention.triton_ops.decode import (
    LaunchOptions,
    decode_attention,
    decode_partials,
    decode_reduce,
    graph_num_kv_splits,
    launch_options,
)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS_PER_GRAPH = 20


def scattered_slots(bs: int, context: int, device: torch.device) -> torch.Tensor:
    runs = torch.randperm(bs * context // 16 + 1, generator=torch.Generator().manual_seed(0))
    slots = (runs[:, None] * 16 + torch.arange(16)).flatten()[: bs * context]
    return slots.to(torch.int32).to(device)


def graph_time_ms(fn: Callable[[], None], reps: int, calls: int = LAYERS_PER_GRAPH) -> float:
    """Median ms of one call, from replays of a graph that calls it `calls` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times[2:])


def sweep(
    bs: int, context: int, reps: int, only: list[tuple[int, int, int, int]] | None = None
) -> None:
    device = torch.device("cuda")
    pool_slots = bs * context + 16
    k_buf = torch.randn(pool_slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    q_rows = torch.arange(bs, dtype=torch.int64, device=device)
    kv_indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=device) * context
    kv_indices = scattered_slots(bs, context, device)
    gb = bs * context * 2 * KV_HEADS * HEAD_DIM * 2 / 1e9
    scale = HEAD_DIM**-0.5
    splits_now = graph_num_kv_splits(bs, KV_HEADS, num_sms(device))
    programs = bs * KV_HEADS * splits_now  # a group of 4 query heads fits one program
    options_now = launch_options(splits_now, programs, num_sms(device))
    current = (splits_now, *dataclasses.astuple(options_now))
    results = []
    configs = only or list(
        itertools.product([1, 2, 4, 8, 16], [32, 64, 128], [2, 4, 8], [1, 2, 3, 4])
    )
    for splits, block_n, warps, stages in [*configs, *([current] if only else [])]:
        mid_out = torch.empty(bs, HEADS, splits, HEAD_DIM, dtype=torch.float32, device=device)
        mid_lse = torch.empty(bs, HEADS, splits, dtype=torch.float32, device=device)
        opts = LaunchOptions(block_n, warps, stages)

        def engine(mo=mid_out, ml=mid_lse, o=opts) -> None:
            decode_attention(
                q, k_buf, v_buf, out, q_rows, kv_indptr, kv_indices, mo, ml, scale, options=o
            )

        def stage1(mo=mid_out, ml=mid_lse, o=opts) -> None:
            decode_partials(
                q, k_buf, v_buf, q_rows, kv_indptr, kv_indices, mo, ml, scale, options=o
            )

        def both(mo=mid_out, ml=mid_lse, s1=stage1) -> None:
            s1()
            decode_reduce(mo, ml, out, q_rows, kv_indptr)

        try:
            ms = graph_time_ms(engine, reps)
            ms2 = graph_time_ms(both, reps) if splits == 1 else ms
            ms1 = graph_time_ms(stage1, reps)
        except Exception as exc:  # a configuration that does not compile: skipped
            print(f"bs {bs} splits {splits} bn {block_n} w {warps} st {stages}: {exc!r:.80}")
            continue
        results.append((ms, ms2, ms1, splits, block_n, warps, stages))
    results.sort()
    mine = [r for r in results if r[3:] == current]
    print(f"\nbs {bs}, context {context}: {gb * 1e3:.1f} MB of KV per layer")
    print(f"{'':>9} {'ms':>7} {'GB/s':>6} {'2-stage':>7} {'stage1':>7} splits block_n warps stages")
    for tag, r in [("current", mine[0])] if mine else []:
        print(f"{tag:>9} {r[0]:7.4f} {gb / r[0] * 1e3:6.0f} {r[1]:7.4f} {r[2]:7.4f} {r[3:]}")
    for r in results if only else results[:8]:
        print(f"{'best':>9} {r[0]:7.4f} {gb / r[0] * 1e3:6.0f} {r[1]:7.4f} {r[2]:7.4f} {r[3:]}")
    try:
        import flashinfer
    except ImportError:
        return
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        kv_indptr, kv_indices, torch.ones(bs, dtype=torch.int32, device=device),
        HEADS, KV_HEADS, HEAD_DIM, 1, q_data_type=torch.bfloat16,
    )  # fmt: skip
    cache = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
    try:
        ms = graph_time_ms(lambda: wrapper.run(q, cache, out=out), reps)
    except RuntimeError as exc:
        print(f"flashinfer: {exc!r:.120}")
        return
    print(f"{'flashinf':>9} {ms:7.4f} {gb / ms * 1e3:6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=528)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="SPLITS,BLOCK_N,WARPS,STAGES",
        help="time these configurations (and the current one) instead of the sweep",
    )
    args = ap.parse_args()
    only = [tuple(int(v) for v in c.split(",")) for c in args.only] if args.only else None
    for bs in args.batch_sizes:
        sweep(bs, args.context, args.reps, only)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
