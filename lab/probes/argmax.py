"""Greedy rows' argmax: the Triton kernels (engine/kernels/triton_ops/argmax.py, what
`sampler.argmax_rows` runs on CUDA) against torch's `argmax(dim=-1)` on [rows, 128256]
bf16 logits, us a call: replayed from a CUDA graph (device time, as inside a step) and
eager (the host launching each call), with the results checked equal.

    python lab/probes/argmax.py [--rows 1 8 16 32 64 128 512 --block 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import VOCAB, time_ms  # noqa: E402


def _graph_us(fn: Callable[[], object], reps: int, calls: int = 20) -> float:
    """us a call, `calls` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay, reps) * 1e3 / calls


def _cell(fn: Callable[[], object], reps: int) -> str:
    return f"{_graph_us(fn, reps):5.1f} / {time_ms(fn, reps) * 1e3:5.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--block", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lab/probes/argmax.py needs a CUDA device")
    from radixserve.engine.kernels.triton_ops import argmax

    print(f"{torch.cuda.get_device_name()}; us a call (graph / eager)")
    print("rows  torch          " + "  ".join(f"triton {b:<5d}      " for b in args.block))
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device="cuda").bfloat16()
        logits[:, 7] = logits.max()  # a tie: the first index must win
        want = logits.argmax(dim=-1)
        cells = [_cell(functools.partial(torch.argmax, logits, dim=-1), args.reps)]
        for block in args.block:
            argmax.BLOCK = block
            if not torch.equal(argmax.argmax_triton(logits), want):
                raise SystemExit(f"rows {rows}, block {block}: not torch's argmax")
            cells.append(_cell(functools.partial(argmax.argmax_triton, logits), args.reps))
        print(f"{rows:4d}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
