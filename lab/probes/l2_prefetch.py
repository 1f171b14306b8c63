"""Does the small kernel before a GEMM, prefetching the GEMM's weight into L2, shorten a
decode step of 64 tokens? A probe.

At 64 tokens on an H200 the step's cuBLASLt GEMMs run 0.5 ms over their weights' read
time (docs/performance.md), much of it each kernel's ramp: its first K-slices read from
HBM while nothing else streams. The RMSNorm and SiLU x mul kernels before qkv, gate_up and
down are latency-bound (~2-3 us, HBM nearly idle). Here each of them also issues
`cp.async.bulk.prefetch.L2` for the first BYTES of every row of the next weight (the
slices the GEMM's programs read first), so the GEMM may find them in L2.

A chain of 32 layers of the Llama-3.1-8B shape (add + RMSNorm, qkv, o, add + RMSNorm,
gate_up, SiLU x mul, down; no attention) at `--rows` tokens, captured in one CUDA graph
per variant, replayed in turn: the engine's own norm and SiLU kernels, this file's
kernels without prefetch (the control), and with prefetches of each `--bytes`.

    python lab/probes/l2_prefetch.py --rows 64 --bytes 512 1024 2048   # needs a Hopper GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixserve.engine.blas import prefer_cublaslt
from radixserve.engine.kernels.triton_ops.activation import silu_and_mul_triton
from radixserve.engine.kernels.triton_ops.norm import fused_add_rms_norm_triton

HIDDEN, INTER, QKV = 4096, 14336, 6144
LAYERS = 32


@triton.jit
def _prefetch_rows(W, stride_w, first, count, Size, ROWS: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of Size bytes at the start of rows first..first+count."""
    rows = first + tl.arange(0, ROWS)
    ptrs = W + rows.to(tl.int64) * stride_w
    size = tl.full([ROWS], 0, tl.int32) + Size
    keep = tl.arange(0, ROWS) < count
    ptrs = tl.where(keep, ptrs, W)
    size = tl.where(keep, size, 16)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _add_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    W,
    stride_w,
    w_rows,
    Size,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if PREFETCH:
        per = tl.cdiv(w_rows, tl.num_programs(0))
        first = tl.program_id(0) * per
        _prefetch_rows(W, stride_w, first, tl.minimum(per, w_rows - first), Size, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(Residual + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(ResidualOut.dtype.element_ty)
    tl.store(ResidualOut + row * N + offs, summed, mask=mask)
    x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * (x * rstd).to(X.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty)
    tl.store(Out + row * N + offs, y, mask=mask)


@triton.jit
def _silu_mul_kernel(
    GateUp,
    Out,
    W,
    stride_w,
    w_rows,
    Size,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROWS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if PREFETCH:
        programs = tl.num_programs(0) * tl.num_programs(1)
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        per = tl.cdiv(w_rows, programs)
        first = pid * per
        _prefetch_rows(
            W, stride_w, first, tl.maximum(tl.minimum(per, w_rows - first), 0), Size, ROWS
        )
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = GateUp + token * 2 * N
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + token * N + offs, (silu * up).to(Out.dtype.element_ty), mask=mask)


def add_norm(x, residual, weight, nxt, size):
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    rows = x.shape[0]
    per = triton.cdiv(nxt.shape[0], rows)
    _add_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        out,
        res_out,
        nxt,
        nxt.stride(0),
        nxt.shape[0],
        max(size, 16),
        1e-5,
        N=x.shape[1],
        BLOCK=triton.next_power_of_2(x.shape[1]),
        PREFETCH=size > 0,
        ROWS=triton.next_power_of_2(per),
        num_warps=8,
    )
    return out, res_out


def silu_mul(gate_up, nxt, size):
    tokens, width = gate_up.shape
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    grid = (tokens, triton.cdiv(n, 1024))
    per = triton.cdiv(nxt.shape[0], grid[0] * grid[1])
    _silu_mul_kernel[grid](
        gate_up,
        out,
        nxt,
        nxt.stride(0),
        nxt.shape[0],
        max(size, 16),
        N=n,
        BLOCK=1024,
        PREFETCH=size > 0,
        ROWS=max(triton.next_power_of_2(per), 2),
        num_warps=4,
    )
    return out


def chain(
    layers: list[dict[str, torch.Tensor]], x0: torch.Tensor, way: str, size: int
) -> Callable[[], None]:
    def step() -> None:
        x, res = x0, x0
        for layer in layers:
            if way == "engine":
                h, res = fused_add_rms_norm_triton(x, res, layer["norm1"], 1e-5)
            else:
                h, res = add_norm(x, res, layer["norm1"], layer["qkv"], size)
            qkv = F.linear(h, layer["qkv"])
            o = F.linear(qkv[:, :HIDDEN], layer["o"])
            if way == "engine":
                h, res = fused_add_rms_norm_triton(o, res, layer["norm2"], 1e-5)
            else:
                h, res = add_norm(o, res, layer["norm2"], layer["gate_up"], size)
            gate_up = F.linear(h, layer["gate_up"])
            act = (
                silu_and_mul_triton(gate_up)
                if way == "engine"
                else silu_mul(gate_up, layer["down"], size)
            )
            x = F.linear(act, layer["down"])

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--bytes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    prefer_cublaslt()
    torch.manual_seed(0)
    bf = torch.bfloat16

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=bf) * 0.02

    layers = [
        {
            "qkv": w(QKV, HIDDEN),
            "o": w(HIDDEN, HIDDEN),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
            "norm1": torch.ones(HIDDEN, device=dev, dtype=bf),
            "norm2": torch.ones(HIDDEN, device=dev, dtype=bf),
        }
        for _ in range(LAYERS)
    ]
    results = []
    for rows in args.rows:
        x0 = torch.randn(rows, HIDDEN, device=dev, dtype=bf)
        ways = [("engine", 0), ("probe", 0)] + [("probe", b) for b in args.bytes]
        graphs = {}
        stream = torch.cuda.Stream()
        for way, size in ways:
            fn = chain(layers, x0, way, size)
            with torch.cuda.stream(stream):
                fn()
                fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn()
            graphs[(way, size)] = g
        times: dict[tuple[str, int], list[float]] = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for key, g in graphs.items():
                g.replay()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    g.replay()
                end.record()
                end.synchronize()
                times[key].append(start.elapsed_time(end) / args.replays)
        for (way, size), ts in times.items():
            row = {"rows": rows, "way": way, "bytes": size, "ms": statistics.median(ts), "all": ts}
            results.append(row)
            print(
                f"rows {rows:3d} {way:6s} prefetch {size:5d} B: {row['ms']:.3f} ms  {[round(t, 3) for t in ts]}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
