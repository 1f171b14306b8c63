"""The few-token GEMV (engine/kernels/triton_ops/gemv.py `gemv_rows_triton`) against
torch's GEMM (cuBLASLt) at the Llama-3.1-8B projections, 1 to 16 tokens: a sweep of its
launch options, the best per shape and token count, and a decode step's projections
(32 layers + the head) each way.

Each projection is timed over rotating copies of its weight (>= 400 MB in all), so
every call streams its weight from HBM as in a decode step, not from L2, and the calls
are replayed from a CUDA graph, so no host launch time sits between them.

    python lab/probes/gemv_rows.py                         # needs CUDA
    python lab/probes/gemv_rows.py --rows 2 8 --json gemv_rows.json
    python lab/probes/gemv_rows.py --rows 64 --shapes o down --block-n 64 128 --stages 3 4
    python lab/probes/gemv_rows.py --one-token --block-n 2 4 8 --block-k 1024 2048 --stages 2 3 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import measure_bandwidth, time_ms  # noqa: E402

LAYERS = 32
# (name, n, k): out = x [m, k] @ W [n, k]^T.
SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("head", 128256, 4096),
]
ROTATION_BYTES = 400e6
# The one-token GEMV's prologue for each projection, as the engine runs it (gate_up also
# with its SiLU x mul epilogue).
ONE_TOKEN_PROLOGUE = {"qkv": "ADD_NORM", "o": "PLAIN", "gate_up": "ADD_NORM", "down": "PLAIN"}


def _copies(n: int, k: int) -> list[torch.Tensor]:
    count = max(1, int(ROTATION_BYTES // (n * k * 2)) + 1)
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(count)]


def _per_call_us(fn, weights: list[torch.Tensor], reps: int) -> float:  # type: ignore[no-untyped-def]
    """Microseconds a call, the calls over every copy captured in one CUDA graph (as a
    decode step runs them: no host launch time between kernels)."""

    def sweep() -> None:
        for w in weights:
            fn(w)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sweep()  # compiles, and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sweep()
    return time_ms(graph.replay, reps) * 1e3 / len(weights)


def _one_token_call(gemv, name: str, k: int):  # type: ignore[no-untyped-def]
    """(reference(w), call(w, config)): the one-token GEMV (module `gemv`) with the
    engine's prologue for the projection `name` (and gate_up's SiLU x mul epilogue), and
    its float32 result from the torch references of the unfused ops."""
    from radixserve.engine.kernels.activation import silu_and_mul_torch
    from radixserve.engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch

    prologue = ONE_TOKEN_PROLOGUE.get(name, "NORM")
    gated = name == "gate_up"
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    summed = torch.empty_like(x)
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    eps = 1e-5
    if prologue == "NORM":
        ref_in = rms_norm_torch(x, norm_w, eps)
    elif prologue == "ADD_NORM":
        ref_in = fused_add_rms_norm_torch(x, residual, norm_w, eps)[0]
    else:
        ref_in = x
    kwargs = {"norm_weight": norm_w, "eps": eps} if prologue in ("NORM", "ADD_NORM") else {}
    if prologue == "ADD_NORM":
        kwargs.update(residual=residual, residual_out=summed)
    code = getattr(gemv, prologue)

    def reference(w: torch.Tensor) -> torch.Tensor:
        y = F.linear(ref_in.float(), w.float())
        return silu_and_mul_torch(y) if gated else y

    def call(w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        return gemv.gemv_triton(x, w, None, code, gated=gated, config=config, **kwargs)

    return reference, call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    # The sweep: (BLOCK_N, BLOCK_K, warps, stages), every combination.
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument(
        "--one-token", action="store_true", help="sweep the one-token GEMV (gemv_triton) instead"
    )
    args = ap.parse_args()
    if args.one_token:
        args.rows = [1]
    configs = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages))
    if not torch.cuda.is_available():
        raise SystemExit("lab/probes/gemv_rows.py needs a CUDA device")
    from radixserve.engine.kernels.triton_ops import gemv

    torch.manual_seed(0)
    bandwidth = measure_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        weights = _copies(n, k)
        floor_us = n * k * 2 / bandwidth * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()

            def call(
                w: torch.Tensor, config: tuple[int, int, int, int] | None, x: torch.Tensor = x
            ) -> torch.Tensor:
                return gemv.gemv_rows_triton(x, w, None, config=config)

            if args.one_token:
                reference, call = _one_token_call(gemv, name, k)
                ref = reference(weights[0])
            torch_us = _per_call_us(lambda w, x=x: F.linear(x, w), weights, args.reps)
            timed = []
            for config in configs:
                try:
                    out = call(weights[0], config)
                except Exception as e:  # a tile the SM cannot hold
                    if "OutOfResources" not in type(e).__name__:
                        raise
                    continue
                if not torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2):
                    raise SystemExit(f"{name} m={m} {config}: the GEMV differs from torch")
                us = _per_call_us(
                    lambda w, c=config, call=call: call(w, c),
                    weights,
                    args.reps,
                )
                timed.append((us, config))
            best_us, best = min(timed)
            one = None
            if m == 1:
                # The engine's launch options (with its prologue when sweeping those).
                if args.one_token:
                    one = _per_call_us(lambda w, f=call: f(w, None), weights, args.reps)
                else:
                    one = _per_call_us(
                        lambda w, x=x: gemv.gemv_triton(x, w, None), weights, args.reps
                    )
            row = {
                "shape": name,
                "m": m,
                "floor_us": floor_us,
                "torch_us": torch_us,
                "kernel": "gemv_triton" if args.one_token else "gemv_rows_triton",
                "rows_us": best_us,
                "rows_config": best,
                "gemv_one_us": one,
                "top5": sorted(timed)[:5],
            }
            results.append(row)
            print(
                f"{name:8s} m {m:2d}: floor {floor_us:7.1f} us, torch {torch_us:7.1f}, "
                f"rows {best_us:7.1f} {best}"
                + (f", one-token gemv {one:7.1f}" if one else "")
                + f"  top: {[(round(t, 1), c) for t, c in sorted(timed)[:4]]}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    print("\nA decode step's projections (32 layers + head), ms:")
    for m in args.rows if len(args.shapes) == len(SHAPES) else []:
        rows = {r["shape"]: r for r in results if r["m"] == m}

        def step(key: str, rows: dict = rows) -> float:  # type: ignore[type-arg]
            layer = sum(rows[s][key] for s in ("qkv", "o", "gate_up", "down"))
            return (LAYERS * layer + rows["head"][key]) / 1e3

        print(
            f"m {m:2d}: floor {step('floor_us'):.3f}, torch {step('torch_us'):.3f}, "
            f"rows {step('rows_us'):.3f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bandwidth, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
