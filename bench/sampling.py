"""The sampler alone: time per call of `engine.sampling.sample` over a decode batch's
logits (Llama-3 vocabulary, 128256), by sampling settings and batch size.

Each setting is one `SamplingBatch` as the scheduler builds it (`SamplingBatch.build`
from plain requests) and one `sample` call on [bs, vocab] bf16 logits; the figure is the
median over `--reps` calls, timed with CUDA events (device time, what a step waits for).
Each sampled setting runs twice, side by side: `triton` (what `sample` takes on CUDA: the
one-kernel draw) and `torch` (the sort-based path the CPU takes), with the share of rows
where the two drew the same token.
Logits are random normal x `--scale` (the sort-based paths do not depend on the values).
Where FlashInfer is installed, its `top_k_top_p_sampling_from_logits` runs beside the
top-k + top-p setting for reference (another random stream: not the engine's draw).

    python bench/sampling.py [--batch-sizes 1 64 256 512 --reps 20]
    python bench/sampling.py --sweep   # the kernel's launch choices, best first
    python bench/sampling.py --cpu     # the CPU path (SmolLM2's 49152-token vocabulary):
                                       # its candidate search beside a whole-row sort
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch
from common import VOCAB, time_ms

from radixserve.engine.kernels import dispatch
from radixserve.engine.sampling import sampler
from radixserve.engine.sampling.batch import SamplingBatch, SamplingRequest
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sampling.sampler import sample

SETTINGS: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "top-k 50": {"temperature": 0.7, "top_k": 50},
    "top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top-k 50 + top-p 0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "min-p 0.05": {"temperature": 0.7, "min_p": 0.05},
}


_TRITON = dispatch.use_triton


def _no_triton(x: torch.Tensor) -> bool:
    return False


def time_cpu_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cpu_bench(batch_sizes: list[int], reps: int, scale: float) -> list[dict[str, object]]:
    """The CPU's torch path: top-k/top-p decided among each row's most probable tokens
    (`sampler.CANDIDATES`), beside the same with every row sorted whole."""
    vocab = 49152
    tiers = sampler.CANDIDATES
    rows: list[dict[str, object]] = []
    for bs in batch_sizes:
        gen = torch.Generator().manual_seed(bs)
        logits = torch.randn(bs, vocab, generator=gen) * scale
        for name, fields in SETTINGS.items():
            params = SamplingParams(**fields)  # type: ignore[arg-type]
            reqs = [SamplingRequest(params=params, seed=i, output_ids=[1] * 7) for i in range(bs)]
            batch = SamplingBatch.build(reqs, vocab, "cpu")
            picks = {}
            for path, path_tiers in (("candidates", tiers), ("full sort", ())):
                sampler.CANDIDATES = path_tiers
                ms = time_cpu_ms(lambda b=batch, x=logits: sample(x, b), reps)
                picks[path] = sample(logits, batch).next_token_ids
                rows.append({"bs": bs, "setting": name, "path": path, "ms": ms})
                print(f"bs {bs:4d}  {name:22s} {path:10s} {ms:8.3f} ms", flush=True)
            sampler.CANDIDATES = tiers
            same = float((picks["candidates"] == picks["full sort"]).float().mean())
            rows[-1]["same_picks"] = same
            print(f"bs {bs:4d}  {name:22s} same picks {same:.4f}", flush=True)
    return rows


def sweep(batch_sizes: list[int], reps: int, scale: float) -> None:
    """Time the kernel alone over its launch choices (blocks, thresholds a search pass,
    warps) per batch size and setting; print the five best and today's choice."""
    from radixserve.engine.kernels.triton_ops import sampling as kernel

    chosen = (kernel.BLOCK, kernel.RADIX, kernel.NUM_WARPS)
    device = torch.device("cuda")
    for bs in batch_sizes:
        logits = (torch.randn(bs, VOCAB, device=device) * scale).bfloat16()
        for name, fields in SETTINGS.items():
            params = SamplingParams(**fields)  # type: ignore[arg-type]
            reqs = [SamplingRequest(params=params, seed=i, output_ids=[1] * 7) for i in range(bs)]
            rows = SamplingBatch.build(reqs, VOCAB, device).sampled
            if rows is None:
                continue
            timed = []
            for block, radix, warps in itertools.product((2048, 4096, 8192), (2, 4, 8), (8, 16)):
                kernel.BLOCK, kernel.RADIX, kernel.NUM_WARPS = block, radix, warps
                ms = time_ms(lambda r=rows, x=logits: sampler._draw_triton(x, r), reps)
                timed.append((ms, (block, radix, warps)))
            kernel.BLOCK, kernel.RADIX, kernel.NUM_WARPS = chosen
            now = next(ms for ms, launch in timed if launch == chosen)
            best = " ".join(f"{ms:.3f}@{b}/{r}/{w}" for ms, (b, r, w) in sorted(timed)[:5])
            print(f"bs {bs:4d}  {name:22s} now {now:.3f}  best {best}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="the kernel's launch choices")
    ap.add_argument("--cpu", action="store_true", help="the CPU path")
    ap.add_argument(
        "--no-flashinfer",
        action="store_true",
        help="skip FlashInfer's sampling for reference (its JIT build takes minutes on a "
        "fresh machine)",
    )
    args = ap.parse_args()
    if args.cpu:
        cpu_rows = cpu_bench(args.batch_sizes or [1, 8, 32], args.reps, args.scale)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": "cpu", "rows": cpu_rows}, f, indent=1)
        return
    args.batch_sizes = args.batch_sizes or [1, 64, 256, 512]
    if not torch.cuda.is_available():
        raise SystemExit("bench/sampling.py needs a CUDA device")
    if args.sweep:
        sweep(args.batch_sizes, args.reps, args.scale)
        return
    device = torch.device("cuda")
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    if args.no_flashinfer:
        flashinfer = None
    rows = []
    for bs in args.batch_sizes:
        gen = torch.Generator(device=device).manual_seed(bs)
        logits = (torch.randn(bs, VOCAB, generator=gen, device=device) * args.scale).bfloat16()
        for name, fields in SETTINGS.items():
            params = SamplingParams(**fields)  # type: ignore[arg-type]
            reqs = [SamplingRequest(params=params, seed=i, output_ids=[1] * 7) for i in range(bs)]
            batch = SamplingBatch.build(reqs, VOCAB, device)
            picks = {}
            for path in ("triton", "torch") if batch.sampled is not None else ("triton",):
                dispatch.use_triton = _TRITON if path == "triton" else _no_triton
                ms = time_ms(lambda b=batch, x=logits: sample(x, b), args.reps)
                picks[path] = sample(logits, batch).next_token_ids
                rows.append({"bs": bs, "setting": name, "path": path, "ms": ms})
                print(f"bs {bs:4d}  {name:22s} {path:6s} {ms:8.3f} ms", flush=True)
            dispatch.use_triton = _TRITON
            if len(picks) == 2:
                same = float((picks["triton"] == picks["torch"]).float().mean())
                rows[-1]["same_picks"] = same
                print(f"bs {bs:4d}  {name:22s} same picks {same:.4f}", flush=True)
        if flashinfer is not None:
            ks = torch.full((bs,), 50, dtype=torch.int32, device=device)
            ps = torch.full((bs,), 0.9, dtype=torch.float32, device=device)
            scaled = logits.float() / 0.7
            ms = time_ms(
                lambda x=scaled, k=ks, p=ps: flashinfer.sampling.top_k_top_p_sampling_from_logits(
                    x, k, p
                ),
                args.reps,
            )
            rows.append({"bs": bs, "setting": "flashinfer top-k 50 + top-p 0.9", "ms": ms})
            print(f"bs {bs:4d}  {'flashinfer k50+p0.9':22s} {ms:8.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
