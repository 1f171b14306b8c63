"""What bench/offline.py measures about each engine step beside its time: the collector's
pauses, the CUDA caching allocator's stalls, the Triton kernels built inside steps, the
device's time (two CUDA events a step), the run's profile by step kind, and the host's
sampled stacks (bench/common/host_stacks.py)."""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.host_stacks import StackSampler
from radixserve import Engine


@dataclass(frozen=True)
class Step:
    """One engine step of a run, as the bench saw it."""

    seconds: float
    prefill_tokens: int
    decode_rows: int
    running_after: int
    # On CUDA (DeviceClock): the device's time for the step, and its idle time before it.
    device_s: float = 0.0
    idle_s: float = 0.0
    # The host's time in the step blocked on the device (the tokens of the step before, under
    # overlap): the rest of `seconds` is its own work.
    wait_s: float = 0.0
    # Triton kernels built in the step (KernelBuilds) and the host's seconds in them.
    kernel_builds: int = 0
    kernel_builds_s: float = 0.0


ROW_BUCKET = 32
ROW_QUANTILES = (0, 10, 25, 50, 75, 90, 100)
SLOWEST = 8  # steps listed by time, with their index and shape
STACK_LINES = 60  # functions listed by --host-stacks
SLOWEST_HOST = 5  # steps whose host stacks --host-stacks also lists apart


class GcClock:
    """Time spent in the interpreter's garbage collections while in use (gc.callbacks):
    a full collection over a big engine's objects pauses the host, and the GPU with it."""

    def __init__(self) -> None:
        self.seconds = self.longest = 0.0
        self.by_generation = [0, 0, 0]
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.seconds += took
        self.longest = max(self.longest, took)
        self.by_generation[info["generation"]] += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class KernelBuilds:
    """Triton kernels built in this process while in use, each with the step it came in
    (`step`, set by the caller before each step) and the host's time in it: Triton calls
    triton.knobs' jit_cache_hook before it builds a kernel variant it has not built in
    this process (compiled, or loaded from its on-disk cache) and jit_post_compile_hook
    after. A build inside a step stalls the host, and under it the device, for
    milliseconds (a load) to a second (a compile). The hooks that were set are called
    too, and set back on exit. Records nothing where this Triton has no such hooks."""

    def __init__(self) -> None:
        self.step = -1
        # (step, kernel name, seconds) in the order built.
        self.builds: list[tuple[int, str, float]] = []
        self._began: float | None = None
        self._knobs: Any = None
        self._saved: tuple[Any, Any] = (None, None)

    def _before(self, **kwargs: Any) -> Any:
        self._began = time.perf_counter()
        return self._saved[0](**kwargs) if self._saved[0] else None

    def _after(self, **kwargs: Any) -> Any:
        took = 0.0 if self._began is None else time.perf_counter() - self._began
        self._began = None
        fn = kwargs.get("fn")
        self.builds.append((self.step, str(getattr(fn, "name", fn)), took))
        return self._saved[1](**kwargs) if self._saved[1] else None

    def by_step(self) -> dict[int, tuple[int, float]]:
        """{step: (kernels built in it, the host's seconds in them)}."""
        out: dict[int, tuple[int, float]] = {}
        for step, _, took in self.builds:
            count, seconds = out.get(step, (0, 0.0))
            out[step] = (count + 1, seconds + took)
        return out

    def __enter__(self) -> KernelBuilds:
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._knobs = runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._saved
            self._knobs = None


# torch's caching allocator's counters that mean a stall: a cudaMalloc that failed, so
# the allocator synchronised and freed its cached blocks to retry; and device mallocs and
# frees (each may synchronise the device).
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counts(engine: Engine) -> dict[str, int]:
    """The allocator's counters (ALLOCATOR_COUNTERS) on the engine's device; none on CPU."""
    if engine.runner.device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(engine.runner.device)
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTERS}


class DeviceClock:
    """The device's side of each step, from two CUDA events a step on the current stream
    (no profiler): one recorded before `engine.step()`, one after. Read after the run: a
    step's device time runs from the last step's end event to its own (under overlap, its
    kernels, with any gaps between them while the host launched behind: the step's wait
    for the device tells which), and the device sat idle before it from the last end
    event to its start event (a host that fell behind between steps). Records nothing
    off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None

    def begin(self) -> None:
        if self.enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self) -> None:
        if self.enabled:
            assert self._start is not None
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._events.append((self._start, done))

    def read(self) -> list[tuple[float, float]]:
        """(device seconds, idle seconds before) for each step, once the device has
        finished them; empty off CUDA."""
        out: list[tuple[float, float]] = []
        for i, (start, done) in enumerate(self._events):
            since = start if i == 0 else self._events[i - 1][1]
            idle = 0.0 if i == 0 else since.elapsed_time(start) / 1e3
            out.append((since.elapsed_time(done) / 1e3, idle))
        return out


def stack_reports(
    sampler: StackSampler, steps: Sequence[Step], window: tuple[int, int]
) -> dict[str, list[str]]:
    """The host's sampled stacks over the window's steps, and over the SLOWEST_HOST of
    them where its own time (a step's time less its wait for the device) was longest."""
    first, last = window
    own = {i: s.seconds - s.wait_s for i, s in enumerate(steps) if first <= i <= last}
    slowest = sorted(own, key=lambda i: -own[i])[:SLOWEST_HOST]
    return {
        "host_stacks": sampler.tally().report(top=STACK_LINES),
        "host_stacks_slowest_steps": [
            f"steps {', '.join(f'{i} ({1e3 * own[i]:.1f} ms)' for i in slowest)}",
            *sampler.tally(slowest).report(top=STACK_LINES),
        ],
    }


def step_profile(steps: Sequence[Step]) -> dict[str, Any]:
    """Where the run's time went: steps that prefilled (mixed with decode rows or not)
    against pure decode steps, and how many rows the decode steps carried (quantiles, and
    steps per 32-row bucket keyed by its lowest row count). Under overlap a step's time is
    its planning plus the wait for the step before it, so the sums add up to the run's
    duration."""
    prefill = [s for s in steps if s.prefill_tokens > 0]
    decode = [s for s in steps if s.prefill_tokens == 0]
    rows = sorted(s.decode_rows for s in decode)

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    buckets = Counter(r // ROW_BUCKET * ROW_BUCKET for r in rows)
    return {
        "steps": len(steps),
        "prefill_steps": len(prefill),
        "prefill_steps_s": sum(s.seconds for s in prefill),
        "prefill_steps_device_s": sum(s.device_s for s in prefill),
        "prefill_steps_wait_s": sum(s.wait_s for s in prefill),
        "prefill_tokens_per_step": mean([s.prefill_tokens for s in prefill]),
        "running_in_prefill_steps": mean([s.running_after for s in prefill]),
        "decode_steps": len(decode),
        "decode_steps_s": sum(s.seconds for s in decode),
        "decode_steps_device_s": sum(s.device_s for s in decode),
        "decode_steps_wait_s": sum(s.wait_s for s in decode),
        "device_idle_s": sum(s.idle_s for s in steps),
        "running_in_decode_steps": mean([s.running_after for s in decode]),
        "decode_rows_quantiles": {
            f"p{q}": rows[min(len(rows) - 1, len(rows) * q // 100)] for q in ROW_QUANTILES
        }
        if rows
        else {},
        "decode_steps_by_rows": {str(k): buckets[k] for k in sorted(buckets)},
        "slowest_steps": [
            {
                "index": i,
                "s": s.seconds,
                "device_s": s.device_s,
                "idle_s": s.idle_s,
                "wait_s": s.wait_s,
                "prefill_tokens": s.prefill_tokens,
                "rows": s.decode_rows,
                "kernel_builds": s.kernel_builds,
                "kernel_builds_s": s.kernel_builds_s,
            }
            for i, s in sorted(enumerate(steps), key=lambda p: -p[1].seconds)[:SLOWEST]
        ],
    }
