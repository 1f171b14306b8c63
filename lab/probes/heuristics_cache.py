"""cuBLASLt's heuristics cache against an eager step's row counts: a probe.

Every eager step (a prefill chunk with the decoders beside it, past the prefill pieces'
largest bucket) runs the model's projections at its own row count. cuBLASLt chooses an
algorithm per problem and caches the choice; a problem it has not seen costs a heuristic
on the host. A server that meets thousands of distinct row counts may cycle that cache
(engine/blas.py sizes it at start-up; docs/performance.md has this probe's figures). This probe, on the 8B shape's four
projections (bf16, torch's matmul through cuBLASLt as the engine runs it), asks:

1. `key`: is the choice cached per problem or per call? A new row count, timed on
   `--layers` layers' distinct weights in turn (as a step's layers run it), then again;
2. `cycle`: the capacity the process starts with (`cublasLtHeuristicsCacheGetCapacity`),
   and the host time per call over `--counts` row counts from `--first` run twice in a
   row, at that capacity and then raised to `--capacity` (engine/blas.py's
   `size_heuristics_cache`): a second pass that still misses means the counts' problems
   overflow the cache.

    python lab/probes/heuristics_cache.py --counts 3072
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from gemv_rows import SHAPES

from radixserve.engine import blas

HIDDEN = 4096
# (name, out features, in features) of the 8B shape's four projections (not the head)
PROJECTIONS = [shape for shape in SHAPES if shape[0] != "head"]


def peak_rss_mib() -> float:
    """The process's peak resident memory (it only grows here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(x: torch.Tensor, w: torch.Tensor) -> float:
    """Host microseconds to launch one projection."""
    started = time.perf_counter()
    F.linear(x, w)
    return (time.perf_counter() - started) * 1e6


def key_probe(inputs: dict[int, torch.Tensor], rows: list[int], layers: int) -> None:
    weights = {
        name: [torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        for name, out, inp in PROJECTIONS
    }
    firsts: list[float] = []
    later: list[float] = []
    again: list[float] = []
    for m in rows:
        for name, _, inp in PROJECTIONS:
            x = inputs[inp][:m]
            times = [timed(x, w) for w in weights[name]]
            torch.cuda.synchronize()
            firsts.append(times[0])
            later.extend(times[1:])
            again.extend(timed(x, w) for w in weights[name])
            torch.cuda.synchronize()
    print(
        f"key: {len(rows)} new row counts x 4 projections x {layers} layers' weights, host us "
        f"a call (median; max): first layer {statistics.median(firsts):.1f}; {max(firsts):.0f}, "
        f"layers after it {statistics.median(later):.1f}; {max(later):.0f}, "
        f"all layers again {statistics.median(again):.1f}; {max(again):.0f}",
        flush=True,
    )


def one_pass(
    inputs: dict[int, torch.Tensor], weights: dict[str, torch.Tensor], rows: range
) -> tuple[float, float]:
    """(median, 90th percentile) host us a call over every row count's four projections."""
    times = []
    for m in rows:
        for name, _, inp in PROJECTIONS:
            times.append(timed(inputs[inp][:m], weights[name]))
        torch.cuda.synchronize()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=513, help="the first row count")
    ap.add_argument("--counts", type=int, default=3072, help="row counts cycled")
    ap.add_argument("--capacity", type=int, default=65536, help="the raised capacity")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("lab/probes/heuristics_cache.py needs a CUDA GPU", file=sys.stderr)
        return 2
    blas.prefer_cublaslt()
    largest = args.first + args.counts + 64
    inputs = {
        inp: torch.randn(largest, inp, device="cuda", dtype=torch.bfloat16)
        for inp in {p[2] for p in PROJECTIONS}
    }
    weights = {
        name: torch.randn(out, inp, device="cuda", dtype=torch.bfloat16)
        for name, out, inp in PROJECTIONS
    }
    F.linear(inputs[HIDDEN][:8], weights["o"])
    torch.cuda.synchronize()
    lib = blas.cublaslt_library()
    if lib is None or blas.CAPACITY_ENV in os.environ:
        print(f"libcublasLt is not loaded, or {blas.CAPACITY_ENV} is set", file=sys.stderr)
        return 2
    start_capacity = blas.heuristics_cache_size(lib)
    print(
        f"{torch.cuda.get_device_name()}: cuBLASLt heuristics cache capacity {start_capacity}",
        flush=True,
    )
    key_probe(inputs, list(range(largest - 64 + 1, largest + 1, 4)), args.layers)
    rows = range(args.first, args.first + args.counts)
    problems = 4 * len(rows)
    for cap in (start_capacity, args.capacity):
        if cap is not None:
            blas.size_heuristics_cache(cap)
        before = peak_rss_mib()
        passes = [one_pass(inputs, weights, rows) for _ in range(2)]
        print(
            f"cycle at capacity {blas.heuristics_cache_size(lib)}: {len(rows)} row counts "
            f"from {args.first} ({problems} problems), host us a call (median, p90): first "
            f"pass {passes[0][0]:.1f}, {passes[0][1]:.1f}; second pass {passes[1][0]:.1f}, "
            f"{passes[1][1]:.1f}; peak host RSS {before:.0f} -> {peak_rss_mib():.0f} MiB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
