"""How busy the GPU is during an offline run: device-bound or host-bound steps.

Runs one workload of bench/offline.py (radix on) and, at the given steps, records a
window of steps with the profiler's CUDA activity only (no host-side tracing, which
slows the host several-fold and makes every step look host-bound). For each window:
the span from its first kernel to its last, the time some kernel ran, and the idle
rest. A window near 100% busy is device-bound; host work shows up as idle time.
The engine first runs offline.py's warm-up (the workload's head, short outputs), so
Triton compiles stay out of the windows.

    python lab/probes/gpu_busy.py --tokenizer DIR [--workload shared-prefix --at 40 150 275 450
        --steps 8 --engine-args '{...}'] [--gaps] [--longest N] [--sync-debug]

--longest N prints, per window, its N longest single idle gaps and N longest kernels
(with their offsets into the window), then the window cut into steps at each step's copy
of its sampled ids to the host, each with its device time and its N costliest kernels,
and each step's host time: whether a slow step waited on the host or on the device (with
overlap on, a step's host time is its planning plus the wait for the step before, so
the host times of a smooth device can alternate). --gaps prints, per window, the idle
time summed by the activities either side of each gap. --sync-debug also runs the steps
under `torch.cuda.set_sync_debug_mode("warn")` and prints, by call site, every operation
that made the host wait for the device (an `.item()`, a copy to pageable memory, ...),
with the steps it happened in: a step's one intended wait (its sampled ids, through an
event) is not one of them.

CUDA only (the CPU has no kernels to time).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from radixserve import Engine

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import SHAPES, default_tokenizer_dir, write_model_folder  # noqa: E402
from offline import (  # noqa: E402
    CONTEXT_LEN,
    WORKLOADS,
    run_offline,
    submit_all,
    warmup_requests,
)


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


def gaps_between(events: list[tuple[int, int, str]]) -> list[tuple[int, int, str, str]]:
    """The device's idle gaps (no kernel or copy on any stream) as (length, start, the
    activity that ended last before it, the one that starts it), in time order."""
    events = sorted(events)
    gaps: list[tuple[int, int, str, str]] = []
    end, last = events[0][1], events[0][2]
    for a, b, name in events[1:]:
        if a > end:
            gaps.append((a - end, end, last, name))
        if b >= end:
            end, last = b, name
    return gaps


def idle_gaps(events: list[tuple[int, int, str]], top: int = 12) -> list[str]:
    """The idle gaps summed by the names of the activity that ended before each and the
    one that started after it."""
    by_pair: collections.Counter[tuple[str, str]] = collections.Counter()
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for us, _, before, after in gaps_between(events):
        pair = (before[:60], after[:60])
        by_pair[pair] += us
        counts[pair] += 1
    return [
        f"{us / 1e3:7.2f} ms in {counts[pair]:5d} gaps: {pair[0]}  ->  {pair[1]}"
        for pair, us in by_pair.most_common(top)
    ]


def longest(events: list[tuple[int, int, str]], top: int) -> list[str]:
    """The `top` longest single idle gaps and the `top` longest activities, each with its
    start (ms from the window's first activity) and names."""
    origin = min(a for a, _, _ in events)
    lines = [
        f"gap {us / 1e3:7.2f} ms at {(at - origin) / 1e3:8.1f} ms: {before[:50]}  ->  {after[:50]}"
        for us, at, before, after in sorted(gaps_between(events), reverse=True)[:top]
    ]
    lines += [
        f"ran {(b - a) / 1e3:7.2f} ms at {(a - origin) / 1e3:8.1f} ms: {name[:90]}"
        for a, b, name in sorted(events, key=lambda e: (e[0] - e[1], e[0]))[:top]
    ]
    return lines


def per_step(events: list[tuple[int, int, str]], top: int) -> list[str]:
    """The window cut at each copy to the host (a step's sampled ids): each piece's
    activity time and its `top` kernels by summed time (names cut to 40 characters)."""
    events = sorted(events)
    pieces: list[list[tuple[int, int, str]]] = [[]]
    for event in events:
        pieces[-1].append(event)
        if event[2].startswith("Memcpy DtoH"):
            pieces.append([])
    lines = []
    for i, piece in enumerate(p for p in pieces if p):
        by_name: collections.Counter[str] = collections.Counter()
        for a, b, name in piece:
            by_name[name[:40]] += b - a
        busy, span = busy_and_span([(a, b) for a, b, _ in piece])
        kernels = ", ".join(f"{name} {us / 1e3:.2f}" for name, us in by_name.most_common(top))
        lines.append(f"piece {i}: span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f}: {kernels}")
    return lines


def window(engine: Engine, steps: int, gaps: bool = False, top: int = 0) -> tuple[float, float]:
    """Busy and span (ms) of the kernels of the next `steps` engine steps; with `gaps`,
    prints where the idle time fell; with `top`, the longest single gaps and activities
    and each step's host time."""
    host: list[float] = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if engine.has_work():
                began = time.perf_counter()
                engine.step()
                host.append(time.perf_counter() - began)
        torch.cuda.synchronize()
    events = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    busy, span = busy_and_span([(a, b) for a, b, _ in events])
    if gaps and events:
        print("\n".join(idle_gaps(events)))
    if top and events:
        print("\n".join(longest(events, top)))
        print("\n".join(per_step(events, top)))
        print("steps' host ms: " + " ".join(f"{1e3 * t:.0f}" for t in host))
    return busy / 1e3, span / 1e3


class SyncSites:
    """Call sites of the synchronising operations torch warns of in sync-debug mode
    (while entered, if `enabled`; otherwise it records nothing)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.steps: dict[tuple[str, ...], set[int]] = collections.defaultdict(set)
        self.step = 0

    def __enter__(self) -> SyncSites:
        if self.enabled:
            self._show = warnings.showwarning
            warnings.showwarning = self._record  # type: ignore[assignment]
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._show

    def _record(self, message: object, *args: object, **kwargs: object) -> None:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "radixserve" in f.filename or "/bench/" in f.filename
        ]
        site = (str(message).splitlines()[0][:80], *frames[-5:])
        self.counts[site] += 1
        self.steps[site].add(self.step)

    def report(self) -> None:
        print(f"sync-debug: {sum(self.counts.values())} synchronising calls in {self.step} steps")
        for site, n in self.counts.most_common(20):
            steps = sorted(self.steps[site])
            print(f"{n:6d} in {len(steps)} steps (first {steps[:5]}): {site[0]}")
            for frame in site[1:]:
                print(f"         {frame}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    ap.add_argument("--at", type=int, nargs="+", default=[40, 150, 275, 450])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--sync-debug", action="store_true", help="list host waits by call site")
    ap.add_argument("--gaps", action="store_true", help="where each window's idle time fell")
    ap.add_argument(
        "--longest", type=int, default=0, help="the N longest gaps and activities of a window"
    )
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
    with SyncSites(enabled=args.sync_debug) as sync_sites:
        submit_all(engine, workload.requests)
        started, step = time.perf_counter(), 0
        marks = sorted(args.at)
        while engine.has_work():
            sync_sites.step = step
            if marks and step == marks[0]:
                marks.pop(0)
                running = len(engine.scheduler.running)
                busy, span = window(engine, args.steps, args.gaps, args.longest)
                print(
                    f"steps {step}-{step + args.steps - 1} ({running} running): span "
                    f"{span:.1f} ms, kernels {busy:.1f} ms ({100 * busy / span:.1f}% busy), "
                    f"{(span - busy) / args.steps:.2f} ms idle a step"
                )
                step += args.steps
                continue
            engine.step()
            step += 1
        torch.cuda.synchronize()
    if sync_sites.enabled:
        sync_sites.step = step
        sync_sites.report()
    print(f"{args.workload}: {step} steps in {time.perf_counter() - started:.2f} s (with windows)")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
