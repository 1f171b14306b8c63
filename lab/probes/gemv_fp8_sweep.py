"""Sweep the one-token GEMV's launch configs for FP8 weights at the Llama-3.1-8B shapes,
beside the bf16 weights at their default config. Each timing: a CUDA graph of calls over
enough weight copies that L2 holds none of them, replayed; us per call and TB/s.

    python lab/probes/gemv_fp8_sweep.py > sweep.jsonl
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable

import torch

from radixserve.engine.kernels.fp8 import quantize_weight
from radixserve.engine.kernels.triton_ops import gemv

SHAPES = {  # name: (n, k, prologue, gated)
    "qkv": (6144, 4096, gemv.ADD_NORM, False),
    "o": (4096, 4096, gemv.PLAIN, False),
    "gate_up": (28672, 4096, gemv.ADD_NORM, True),
    "down": (4096, 14336, gemv.PLAIN, False),
}
CONFIGS = list(itertools.product((1, 2, 4, 8), (2048, 4096), (4, 8), (3, 4)))
Config = tuple[int, int, int, int] | None


def timed(call_copy: Callable[[int], object], copies: int) -> float:
    """Microseconds a call, best of 5 replays of a graph of 4 rounds over the copies."""
    for i in range(copies):
        call_copy(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            for i in range(copies):
                call_copy(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (5 * 4 * copies))
    return best


def sweep_shape(name: str, n: int, k: int, prologue: int, gated: bool) -> dict[str, object]:
    dev = torch.device("cuda")
    nbytes16 = n * k * 2
    copies = max(2, int(400e6 // nbytes16) + 1)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w8 = [quantize_weight(w) for w in w16]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    extra: dict[str, object] = {}
    if prologue != gemv.PLAIN:
        residual = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        extra = dict(
            residual=residual,
            residual_out=torch.empty_like(residual),
            norm_weight=torch.ones(k, device=dev, dtype=torch.bfloat16),
            eps=1e-5,
        )

    def run16(i: int) -> torch.Tensor:
        return gemv.gemv_triton(x, w16[i], None, prologue, gated=gated, **extra)

    def run8(i: int, config: Config = None) -> torch.Tensor:
        return gemv.gemv_triton(
            x, w8[i].data, None, prologue, gated=gated, weight_scale=w8[i].scale,
            config=config, **extra,
        )  # fmt: skip

    ref = run16(0).float()
    t16 = timed(run16, copies)
    t8 = timed(run8, copies)
    best: tuple[float, Config] = (t8, None)
    for config in CONFIGS:
        if (gated and config[0] > 4) or config[1] > k:
            continue
        try:
            err = float((run8(0, config).float() - ref).abs().max() / ref.abs().max())
            if err > 0.1:
                print(name, config, "error", err, file=sys.stderr)
                continue
            t = timed(lambda i, c=config: run8(i, c), copies)
        except Exception as exc:  # a config the compiler refuses
            print(name, config, type(exc).__name__, file=sys.stderr)
            continue
        best = min(best, (t, config), key=lambda r: r[0])
    return {
        "shape": name,
        "bf16_us": t16,
        "bf16_tbs": nbytes16 / t16 / 1e6,
        "fp8_default_us": t8,
        "fp8_default_tbs": nbytes16 / 2 / t8 / 1e6,
        "fp8_best_us": best[0],
        "fp8_best_config": best[1],
        "fp8_best_tbs": nbytes16 / 2 / best[0] / 1e6,
    }


def main() -> None:
    for name, shape in SHAPES.items():
        print(json.dumps(sweep_shape(name, *shape)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
