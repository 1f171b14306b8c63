"""Decode-step GEMMs at M ~ 256-512 rows: torch (its default library, cuBLAS; the engine
prefers cuBLASLt) against a Triton GEMM that
loads its tiles through TMA descriptors, each chain of 32 layers' weights captured in one
CUDA graph (weights read from HBM, as a decode step reads them).

At M = 476-512 the o and down projections' 4096-wide outputs are 64 tiles of 128 x 256
for 132 SMs: cuBLAS fills half the device. 128 x 128 tiles make 128 programs, one wave.

    python lab/probes/tma_gemm.py                       # needs CUDA (Hopper for TMA)
    python lab/probes/tma_gemm.py --m 476 512 --json tma.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from decode_attention import graph_time_ms
from gemms import SHAPES
from triton.tools.tensor_descriptor import TensorDescriptor

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import measure_matmul  # noqa: E402

LAYERS = 32


@triton.jit
def _tma_gemm_kernel(
    x_desc,  # [M, K]
    w_desc,  # [N, K]
    out_desc,  # [M, N]
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # M-fastest order: the programs sharing a weight tile run side by side, so the
    # weight is read from HBM once and from L2 by the others.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % grid_m
    pid_n = pid // grid_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = tl.dot(a, b.T, acc)
    out_desc.store([off_m, off_n], acc.to(tl.bfloat16))


def tma_gemm(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, ...]
) -> torch.Tensor:
    bm, bn, bk, stages, warps = config
    m, k = x.shape
    n = w.shape[0]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _tma_gemm_kernel[grid](
        x_desc,
        w_desc,
        out_desc,
        m,
        k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        NUM_STAGES=stages,
        num_warps=warps,
    )
    return out


def layer_weights(n: int, k: int) -> list[torch.Tensor]:
    """One [n, k] bf16 weight per layer, each read from HBM when a chain reaches it."""
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]


def write_rows(path: str | None, rate: float, rows: list[dict[str, Any]]) -> None:
    """The rows and the matmul rate they are shares of, as JSON at `path` (if given)."""
    if path:
        with open(path, "w") as f:
            json.dump({"matmul_tflops": rate, "rows": rows}, f, indent=1)


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
CONFIGS = [
    c
    for c in itertools.product((64, 128), (64, 128, 256), (64, 128), (3, 4, 5), (4, 8))
    # shared memory: stages x (BM + BN) x BK x 2 bytes must fit 227 KB
    if c[3] * (c[0] + c[1]) * c[2] * 2 <= 220 * 1024
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[256, 384, 476, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=3, help="configs shown per shape")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rate = measure_matmul(repeats=args.reps) / 1e12
    print(f"matmul rate {rate:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    for name, k, n in SHAPES:
        weights = layer_weights(n, k)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k * LAYERS
            ref = torch.nn.functional.linear(x, weights[0])

            def torch_chain(x=x, out=out, weights=weights):
                for w in weights:
                    torch.matmul(x, w.t(), out=out)

            torch_ms = graph_time_ms(torch_chain, args.reps, calls=1)
            timed = []
            for config in CONFIGS:
                try:
                    got = tma_gemm(x, weights[0], out, config)
                except (triton.runtime.errors.OutOfResources, ValueError, RuntimeError) as exc:
                    print(f"  {name} M={m} {config}: {type(exc).__name__}", flush=True)
                    continue
                if not torch.allclose(got.float(), ref.float(), atol=3e-2, rtol=3e-2):
                    err = (got.float() - ref.float()).abs().max().item()
                    raise SystemExit(f"{name} M={m} {config}: differs from torch by {err}")

                def chain(x=x, out=out, weights=weights, config=config):
                    for w in weights:
                        tma_gemm(x, w, out, config)

                timed.append((graph_time_ms(chain, args.reps, calls=1), config))
            timed.sort()
            row = {
                "m": m,
                "proj": name,
                "torch_ms": torch_ms,
                "torch_share": flop / torch_ms / 1e9 / rate,
                "tma": [(ms, list(c), flop / ms / 1e9 / rate) for ms, c in timed[: args.top]],
            }
            rows.append(row)
            best = "  ".join(
                f"{ms * 1e3 / LAYERS:6.1f} us ({s:.2f}) {c}" for ms, c, s in row["tma"]
            )
            print(
                f"M {m:4d} {name:8s} torch {torch_ms * 1e3 / LAYERS:6.1f} us "
                f"({row['torch_share']:.2f})  tma {best}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    write_rows(args.json, rate, rows)


if __name__ == "__main__":
    main()
