"""The 8B model's projections at the token counts of the shared-prefix run's steps:
torch's GEMM (cuBLASLt, what the engine runs) against a Triton GEMM over a sweep of
tile shapes, each as a share of the device's matmul rate.

A decode step of ~500 requests gives M = 480-512 (its CUDA graph pads to 512); a mixed
step M = 2048 prompt tokens + its decoders. Each call here reads one weight again and
again (from L2 once it fits) and is timed alone: lab/probes/tma_gemm.py times the projections
as a decode step runs them (32 layers' weights in one CUDA graph), where torch's o
projection (its default cuBLAS there) at M = 512 ran at 0.89 of the matmul rate, not the
~0.5 timed here.

    python lab/probes/gemms.py                 # needs CUDA
    python lab/probes/gemms.py --m 512 --json gemms.json
    python lab/probes/gemms.py --steps 256 512 16   # torch alone: a decode step's GEMMs
                                                 # (32 layers + head) at each M
    python lab/probes/gemms.py --steps 2400 2600 1 --blas both   # cuBLAS and cuBLASLt
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import measure_matmul, time_ms  # noqa: E402

# (name, K, N) of Llama-3.1-8B's projections: out = x [M, K] @ W [N, K]^T.
SHAPES = [
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
]
LAYERS = 32
HEAD = ("head", 4096, 128256)


@triton.jit
def _gemm_kernel(
    X,
    W,
    Out,
    M,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = Out + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out, acc.to(Out.dtype.element_ty), mask=mask)


def gemm_triton(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    bm, bn, bk, group, stages, warps = config
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](
        x,
        w,
        out,
        m,
        n,
        K=k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group,
        num_stages=stages,
        num_warps=warps,
    )
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps)
CONFIGS = [
    (bm, bn, 64, 8, stages, warps)
    for bm, bn, stages, warps in itertools.product((64, 128), (128, 256), (3, 4, 5), (4, 8))
] + [(128, 128, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8)]


def step_table(sizes: range, reps: int, blas: str) -> list[dict[str, object]]:
    """Torch's GEMM time of a whole step (32 layers' projections and the head) at each M,
    and for each M the size >= M whose step is fastest (what padding to it would give).
    `blas`: the library torch routes GEMMs to (cublas, cublaslt, or both, side by side at
    each M)."""
    libraries = ["cublas", "cublaslt"] if blas == "both" else [blas]
    weights = {
        name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for name, k, n in [*SHAPES, HEAD]
    }
    step_ms: dict[str, list[float]] = {library: [] for library in libraries}
    rows: list[dict[str, object]] = []
    for m in sizes:
        row: dict[str, object] = {"m": m}
        for library in libraries:
            torch.backends.cuda.preferred_blas_library(library)
            ms = {}
            for name, w in weights.items():
                x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
                ms[name] = time_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), reps)
            step = LAYERS * sum(ms[name] for name, _, _ in SHAPES) + ms["head"]
            step_ms[library].append(step)
            row[f"{library}_step_ms"] = step
            row.update({f"{library}_{name}_us": t * 1e3 for name, t in ms.items()})
        rows.append(row)
    for i, row in enumerate(rows):
        parts = [f"M {row['m']:5d}"]
        for library in libraries:
            times = step_ms[library]
            best = min(range(i, len(rows)), key=times.__getitem__)
            row[f"{library}_pad_to"] = rows[best]["m"]
            parts.append(
                f"{library} {times[i]:6.2f} ms (fastest at or above: M {rows[best]['m']} "
                f"{times[best]:.2f})"
            )
        print("  ".join(parts), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[480, 512, 2528])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--steps", type=int, nargs=3, metavar=("FIRST", "LAST", "STRIDE"))
    ap.add_argument(
        "--blas",
        choices=["cublas", "cublaslt", "both"],
        default="cublaslt",
        help="--steps: torch's GEMM library (the engine's is cublaslt)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lab/probes/gemms.py needs a CUDA device")
    torch.manual_seed(0)
    rate = measure_matmul(repeats=args.reps) / 1e12
    print(f"matmul rate {rate:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    if args.steps:
        first, last, stride = args.steps
        table = step_table(range(first, last + 1, stride), args.reps, args.blas)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"matmul_tflops": rate, "steps": table}, f, indent=1)
        return
    rows = []
    for m, (name, k, n) in itertools.product(args.m, SHAPES):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        flop = 2 * m * n * k
        ref = torch.nn.functional.linear(x, w)
        torch_ms = time_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), args.reps)
        timed = []
        for config in CONFIGS:
            try:
                out = gemm_triton(x, w, config)
            except triton.runtime.errors.OutOfResources:  # a tile the SM cannot hold
                continue
            if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                raise SystemExit(f"{name} M={m} {config}: Triton GEMM differs from torch")
            timed.append(
                (time_ms(lambda x=x, w=w, c=config: gemm_triton(x, w, c), args.reps), config)
            )
        best_ms, best = min(timed)
        row = {
            "m": m,
            "proj": name,
            "torch_ms": torch_ms,
            "torch_share": flop / torch_ms / 1e9 / rate,
            "triton_ms": best_ms,
            "triton_share": flop / best_ms / 1e9 / rate,
            "triton_config": best,
        }
        rows.append(row)
        print(
            f"M {m:5d} {name:8s} torch {torch_ms * 1e3:7.1f} us ({row['torch_share']:.2f})  "
            f"triton {best_ms * 1e3:7.1f} us ({row['triton_share']:.2f}) {best}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_tflops": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
