"""A decode step's projection chain (32 layers of the Llama-3.1-8B shape's qkv, o,
gate_up and down, each reading the one before's output) at a few tokens, captured in a
CUDA graph, run several ways in turn: cuBLASLt for all, the engine's routing, and the
few-token GEMV (engine/kernels/triton_ops/gemv.py) for all, with its launch options:
the next kernel's launch released after the kernel's loop or as soon as its programs
have all passed their wait for the kernel before (`early`). One token runs the
one-token GEMV (the engine's at one token, trigger after the loop) for both.

    python lab/probes/gemv_chain.py --rows 1 8 32 64   # needs CUDA (a Hopper GPU for PDL)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from gemv_rows import SHAPES

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import measure_bandwidth, time_ms  # noqa: E402

CHAIN = ("qkv", "o", "gate_up", "down")


def _chain(
    weights: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[], torch.Tensor]:
    hidden = x.shape[1]

    def step() -> torch.Tensor:
        h = x
        for layer in weights:
            qkv = project(h, layer["qkv"])
            h = project(qkv[:, :hidden], layer["o"])
            gate_up = project(h, layer["gate_up"])
            h = project(gate_up[:, : gate_up.shape[1] // 2], layer["down"])
        return h

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lab/probes/gemv_chain.py needs a CUDA device")
    from radixserve.engine.blas import prefer_cublaslt
    from radixserve.engine.kernels import linear as linear_ops
    from radixserve.engine.kernels.triton_ops import gemv

    prefer_cublaslt()
    torch.manual_seed(0)
    bandwidth = measure_bandwidth()
    shapes = {name: (n, k) for name, n, k in SHAPES}
    weights = [
        {
            name: torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16)
            / shapes[name][1] ** 0.5
            for name in CHAIN
        }
        for _ in range(args.layers)
    ]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    floor_ms = args.layers * layer_bytes / bandwidth * 1e3
    print(
        f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; "
        f"{args.layers} layers' weights {args.layers * layer_bytes / 1e9:.1f} GB, "
        f"floor {floor_ms:.3f} ms",
        flush=True,
    )

    def gemv_way(early: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 1:
                return gemv.gemv_triton(x, w, None)
            return gemv.gemv_rows_triton(x, w, None, early_trigger=early)

        return project

    ways: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "cublaslt": lambda x, w: F.linear(x, w),
        "engine": lambda x, w: linear_ops.linear(x, w, None),
        "gemv, trigger after the loop": gemv_way(early=False),
        "gemv, early trigger": gemv_way(early=True),
    }

    results = []
    for m in args.rows:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        graphs = {}
        ref = None
        for name, project in ways.items():
            step = _chain(weights, x, project)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = step()  # compiles outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float()
            else:
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if err > 0.05:
                    raise SystemExit(f"m={m} {name}: the chain is {err:.3f} off cuBLASLt's")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graphs[name] = graph
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(time_ms(graph.replay, args.reps))
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = {"m": m, "way": name, "ms": ms, "rounds": ts, "of_floor": floor_ms / ms}
            results.append(row)
            print(
                f"m {m:3d} {name:24s} {ms:7.3f} ms ({ms / args.layers * 1e3:6.1f} us a layer, "
                f"{floor_ms / ms:.3f} of the floor)  rounds {[round(t, 3) for t in ts]}",
                flush=True,
            )
        del graphs
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"floor_ms": floor_ms, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
