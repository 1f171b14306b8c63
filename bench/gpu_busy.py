"""How busy the GPU is during an offline run: device-bound or host-bound steps.

Runs one workload of bench/offline.py (radix on) and, at the given steps, records a
window of steps with the profiler's CUDA activity only (no host-side tracing, which
slows the host several-fold and makes every step look host-bound). For each window:
the span from its first kernel to its last, the time some kernel ran, and the idle
rest. A window near 100% busy is device-bound; host work shows up as idle time.
The engine first runs offline.py's warm-up (the workload's head, short outputs), so
Triton compiles stay out of the windows.

    python bench/gpu_busy.py --tokenizer DIR [--workload shared-prefix --at 40 150 275 450
        --steps 8 --engine-args '{...}']

CUDA only (the CPU has no kernels to time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from offline import (
    CONTEXT_LEN,
    SHAPES,
    WORKLOADS,
    default_tokenizer_dir,
    run_offline,
    submit_all,
    warmup_requests,
    write_model_folder,
)
from torch.profiler import ProfilerActivity, profile

from radixserve import Engine


def busy_and_span(intervals: list[tuple[int, int]]) -> tuple[float, float]:
    """(time covered by at least one interval, first start to last end), in the
    intervals' unit; overlapping kernels (several streams) count once."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy = 0
    start, end = intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    return float(busy), float(max(b for _, b in intervals) - intervals[0][0])


def window(engine: Engine, steps: int) -> tuple[float, float]:
    """Busy and span (ms) of the kernels of the next `steps` engine steps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if engine.has_work():
                engine.step()
        torch.cuda.synchronize()
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    busy, span = busy_and_span(kernels)
    return busy / 1e3, span / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    ap.add_argument("--at", type=int, nargs="+", default=[40, 150, 275, 450])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_busy: CUDA is not available", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer or default_tokenizer_dir()
    model = str(write_model_folder(tokenizer, SHAPES["llama-3.1-8b"]))
    engine = Engine(
        model_path=model,
        load_format="dummy",
        context_length=CONTEXT_LEN,
        **json.loads(args.engine_args),
    )
    workload = WORKLOADS[args.workload](1.0, 0)
    run_offline(engine, warmup_requests([workload]))  # kernels compiled outside the windows
    submit_all(engine, workload.requests)
    started, step = time.perf_counter(), 0
    marks = sorted(args.at)
    while engine.has_work():
        if marks and step == marks[0]:
            marks.pop(0)
            running = len(engine.scheduler.running)
            busy, span = window(engine, args.steps)
            print(
                f"steps {step}-{step + args.steps - 1} ({running} running): span {span:.1f} ms, "
                f"kernels {busy:.1f} ms ({100 * busy / span:.1f}% busy), "
                f"{(span - busy) / args.steps:.2f} ms idle a step"
            )
            step += args.steps
            continue
        engine.step()
        step += 1
    torch.cuda.synchronize()
    print(f"{args.workload}: {step} steps in {time.perf_counter() - started:.2f} s (with windows)")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
