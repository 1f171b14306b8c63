"""How fast can a decode kernel read the KV pool, by how it reads a slot? A probe.

The decode kernels read each request's keys and values through the slot table, one
program per (request, KV head): a slot's row for one KV head is 256 bytes (head dim 128,
bf16) inside the slot's 2 KiB (8 KV heads), so each program reads 256-byte pieces 2 KiB
apart, and the eight programs of a request read the same rows at different moments.
docs/performance.md measures the shared-prefix and suffix kernels at ~84% of the copy
rate. This probe reads the same bytes (K and V of `--rows` requests x `--keys` slots,
one layer of the 8B shape) with a minimal kernel that only sums them, three ways:

- `per-head`: a program per (request, KV head), 256-byte pieces (the kernels' pattern);
- `all-heads`: a program per request, whole 2-KiB slot rows;
- `half-heads`: a program per (request, 4 KV heads), 1-KiB pieces;

over slots scattered at random through the pool and over consecutive slots, against a
plain device copy of as many bytes. What it would take to reach more of the copy rate.

    python lab/probes/kv_read_probe.py [--rows 512 --keys 256 --pool-slots 400000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import time_ms  # noqa: E402

KV_HEADS, HEAD_DIM = 8, 128


@triton.jit
def _read_kernel(
    K,
    V,
    slots,  # [rows, keys] int32
    out,  # [rows, KV_HEADS] float32
    keys,
    HEADS_PER_PROGRAM: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head0 = tl.program_id(1) * HEADS_PER_PROGRAM
    cols = tl.arange(0, HEADS_PER_PROGRAM * HEAD_DIM)  # this program's heads, contiguous
    acc = tl.zeros([HEADS_PER_PROGRAM * HEAD_DIM], dtype=tl.float32)
    for start in range(0, keys, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < keys
        s = tl.load(slots + row * keys + offs, mask=mask, other=0).to(tl.int64)
        addr = s[:, None] * (KV_HEADS * HEAD_DIM) + head0 * HEAD_DIM + cols[None, :]
        k = tl.load(K + addr, mask=mask[:, None], other=0.0)
        v = tl.load(V + addr, mask=mask[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    total = tl.sum(acc, 0)
    tl.store(out + row * KV_HEADS + head0, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--pool-slots", type=int, default=400_000)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    k = torch.randn(args.pool_slots, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nbytes = 2 * args.rows * args.keys * KV_HEADS * HEAD_DIM * 2
    src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.reps)
    # A copy reads and writes: its rate counts both, as bench/one_batch.py's does.
    copy_rate = 2 * nbytes / copy_ms / 1e9  # TB/s (bytes a ms / 1e9)
    layouts = {
        "random": torch.randperm(args.pool_slots, device=dev)[: args.rows * args.keys],
        "consecutive": torch.arange(args.rows * args.keys, device=dev),
    }
    out = torch.zeros(args.rows, KV_HEADS, device=dev)
    for name, slots in layouts.items():
        table = slots.to(torch.int32).view(args.rows, args.keys).contiguous()
        for label, per_program in (("per-head", 1), ("half-heads", 4), ("all-heads", 8)):
            for block_n in (16, 32, 64, 128):
                for warps in (4, 8):

                    def run(
                        per_program: int = per_program,
                        block_n: int = block_n,
                        warps: int = warps,
                        table: torch.Tensor = table,
                    ) -> None:
                        _read_kernel[(args.rows, KV_HEADS // per_program)](
                            k, v, table, out, args.keys,
                            HEADS_PER_PROGRAM=per_program, KV_HEADS=KV_HEADS,
                            HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, num_warps=warps,
                        )  # fmt: skip

                    if per_program * HEAD_DIM * block_n > 16 * 1024:
                        continue  # a tile past a program's registers
                    ms = time_ms(run, args.reps)
                    rate = nbytes / ms / 1e9
                    print(json.dumps({
                        "slots": name, "read": label, "block_n": block_n, "warps": warps,
                        "ms": round(ms, 4), "TB/s": round(rate, 3),
                        "of_copy": round(rate / copy_rate, 3),
                    }), flush=True)  # fmt: skip
    print(f"copy of {nbytes / 1e6:.0f} MB: {copy_ms:.4f} ms, {copy_rate:.2f} TB/s "
          f"({torch.cuda.get_device_name()})")  # fmt: skip


if __name__ == "__main__":
    main()
