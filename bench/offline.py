"""Offline throughput of the in-process Engine, like SGLang's bench_offline_throughput.

Every request of a workload is submitted at once as token ids (no tokenization, no
detokenization: `Engine.submit` + `Engine.step`), then the engine steps until all
finish. Greedy, EOS ignored, so each request produces exactly its output length.
Workloads, synthetic and seeded (the generators of `radixserve.benchmark.datasets`):

- `sharegpt`: 1000 requests, ShareGPT-like prompt and output lengths (context 2048);
- `shared-prefix`: 64 groups x 16 prompts, a 2048-token system prompt per group plus a
  128-token question, 256 output tokens.

Each runs with the radix cache on and/or off (`--radix on|off|both`, one engine per
mode, both workloads on it, the cache emptied before each, `--repeat` times in a row);
`both` adds the on/off throughput ratio (of the modes' medians where repeated). On CUDA each run is also read against its floor (bench/common/roofline.py:
its projections and prefill attention at the bf16 matmul rate, its decode attention's
KV reads at the copy bandwidth, both measured at start): `floor_s` and `of_floor` (the
floor over the run's time), and with `both` the ratio of the two floors, the on/off
ratio a run reaches when both modes run at the same share of their floors. `--scale` keeps that fraction of each workload (of its groups for
`shared-prefix`). A slice of each workload warms each engine up first: its first
`WARMUP_REQUESTS` requests at their own prompts with short outputs, so the Triton
kernels of mixed prefill and decode steps compile (on a fresh machine, several seconds)
outside the timed run. Each run also reports its host-side stalls: the time to submit, the
time outside the engine's steps, the collector's pauses, the CUDA caching allocator's
failed mallocs (retried after freeing its cache), device mallocs and frees, and the
Triton kernels built inside its steps (compiled, or loaded from Triton's disk cache: a
kernel variant the start-up and the warm-up slice did not build); each step's
wait for the device (the host's own time is the rest); and on CUDA each step's time on
the device and the device's idle time before it (`DeviceClock`: two events a step, no
profiler). `--host-stacks FIRST LAST` samples the host's Python stacks over those steps
of each run (bench/common/host_stacks.py) and prints where its time went, over the window and
over its steps whose host took longest on its own (bench/common/step_probes.py holds these
per-step measures).

Model: a Llama-3.1-8B-shaped model with random weights built on the device
(`load_format="dummy"`, as bench/one_batch.py) by default; `--shape tiny` a small
Llama for a CPU smoke run; `--model DIR` a checkpoint.

    python bench/offline.py --tokenizer DIR [--workloads sharegpt shared-prefix
        --radix both --scale 0.1 --json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import (
    SHAPES,
    default_tokenizer_dir,
    measure_bandwidth,
    measure_matmul,
    write_model_folder,
)
from common.host_stacks import StackSampler
from common.roofline import ModelShape, RequestWork, work_floor
from common.step_probes import (
    DeviceClock,
    GcClock,
    KernelBuilds,
    Step,
    allocator_counts,
    stack_reports,
    step_profile,
)

from radixserve import Engine
from radixserve.benchmark.datasets import (
    BenchRequest,
    generated_shared_prefix,
    sharegpt_like_requests,
)
from radixserve.engine.request import Req
from radixserve.engine.runner import resolve_device

CONTEXT_LEN = 4096  # fits both workloads (2048 + 128 + 256 the longest)
WARMUP_REQUESTS = 64  # four groups of the shared-prefix workload
WARMUP_OUTPUT_LEN = 16
KERNEL_BUILDS_LISTED = 40


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    # Every request's first `shared_prefix_len` tokens are common to `group_size` of them
    # (that many decode over it together, reading it once, with the radix cache).
    shared_prefix_len: int = 0
    group_size: int = 1


@dataclass(frozen=True)
class Rates:
    """The device's measured bf16 matmul rate (FLOP/s) and copy bandwidth (bytes/s)."""

    matmul: float
    bandwidth: float

    @classmethod
    def measure(cls) -> Rates:
        return cls(matmul=measure_matmul(), bandwidth=measure_bandwidth())


def sharegpt_workload(scale: float = 1.0, seed: int = 0) -> Workload:
    n = max(1, round(1000 * scale))
    return Workload("sharegpt", sharegpt_like_requests(random.Random(seed), n, context_len=2048))


def shared_prefix_workload(scale: float = 1.0, seed: int = 0) -> Workload:
    groups = max(1, round(64 * scale))
    requests = generated_shared_prefix(
        random.Random(seed),
        num_groups=groups,
        prompts_per_group=16,
        system_prompt_len=2048,
        question_len=128,
        output_len=256,
    )
    return Workload("shared-prefix", requests, shared_prefix_len=2048, group_size=16)


WORKLOADS: dict[str, Callable[[float, int], Workload]] = {
    "sharegpt": sharegpt_workload,
    "shared-prefix": shared_prefix_workload,
}


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def submit_all(engine: Engine, requests: Sequence[BenchRequest]) -> None:
    """Queue every request: greedy, exactly its output length (EOS ignored)."""
    for r in requests:
        engine.submit(
            r.prompt, {"max_new_tokens": r.output_len, "ignore_eos": True, "temperature": 0}
        )


def run_offline(
    engine: Engine,
    requests: Sequence[BenchRequest],
    floor: Callable[[list[Req], list[int]], dict[str, float]] | None = None,
    stacks: tuple[int, int] | None = None,
    stacks_interval_s: float = 0.001,
) -> dict[str, Any]:
    """Submit all `requests` at once on an empty cache, step until done; counts and rates
    (and `floor(finished requests, tokens computed by each step)`'s figures, where given;
    with `stacks` = (first, last), the host's stacks sampled over those steps: over all
    of them, and over the SLOWEST_HOST of them where the host's own time was longest)."""
    if not engine.flush_cache():
        raise RuntimeError("the engine has requests running")
    retractions = engine.scheduler.total_retractions
    _sync(engine)
    allocator_before = allocator_counts(engine)
    sampler = StackSampler(threading.get_ident(), stacks_interval_s)
    with (
        GcClock() as gc_clock,
        KernelBuilds() as builds,
        sampler if stacks else contextlib.nullcontext(),
    ):
        started, started_unix = time.perf_counter(), time.time()
        submit_all(engine, requests)
        submitted = time.perf_counter()
        finished = []
        sched = engine.scheduler
        steps: list[Step] = []
        clock = DeviceClock(engine.runner.device)
        while engine.has_work():
            t0, prefilled = time.perf_counter(), sched.total_prefill_tokens
            decoded, waited = sched.total_decode_tokens, sched.total_device_wait_s
            sampler.step = builds.step = len(steps)
            clock.begin()
            # The window is the step alone: samples of the loop around it would dilute it.
            sampler.active = stacks is not None and stacks[0] <= len(steps) <= stacks[1]
            outputs = engine.step()
            sampler.active = False
            clock.end()
            finished += [out.req for out in outputs if out.finished]
            steps.append(
                Step(
                    seconds=time.perf_counter() - t0,
                    prefill_tokens=sched.total_prefill_tokens - prefilled,
                    decode_rows=sched.total_decode_tokens - decoded,
                    running_after=len(sched.running),
                    wait_s=sched.total_device_wait_s - waited,
                )
            )
        _sync(engine)
        duration = time.perf_counter() - started
    for i, (device_s, idle_s) in enumerate(clock.read()):
        steps[i] = replace(steps[i], device_s=device_s, idle_s=idle_s)
    for i, (count, seconds) in builds.by_step().items():
        if 0 <= i < len(steps):
            steps[i] = replace(steps[i], kernel_builds=count, kernel_builds_s=seconds)
    allocator = {
        key: count - allocator_before[key] for key, count in allocator_counts(engine).items()
    }
    done = [
        req
        for req in finished
        if req.finish_reason is not None and req.finish_reason.kind != "abort"
    ]
    input_tokens = sum(len(req.origin_input_ids) for req in done)
    output_tokens = sum(len(req.output_ids) for req in done)
    cached = sum(req.cached_tokens for req in done)
    step_tokens = [s.prefill_tokens + s.decode_rows for s in steps]
    floors = {} if floor is None else floor(done, step_tokens)
    if "floor_s" in floors:
        floors["of_floor"] = floors["floor_s"] / duration
    return {
        "requests": len(requests),
        "completed": len(done),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / max(input_tokens, 1),
        "retractions": engine.scheduler.total_retractions - retractions,
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "started_unix": started_unix,  # the run's start on the wall clock (to align samples)
        "submit_s": submitted - started,
        "outside_steps_s": duration - sum(s.seconds for s in steps),
        "gc_s": gc_clock.seconds,
        "gc_longest_s": gc_clock.longest,
        "gc_collections": gc_clock.by_generation,
        "allocator": allocator,
        # Triton kernels built during the run (step_probes.KernelBuilds): how many, the
        # host's seconds in them, and the first KERNEL_BUILDS_LISTED as (step, kernel, ms).
        "kernel_builds": len(builds.builds),
        "kernel_builds_s": sum(took for _, _, took in builds.builds),
        "kernel_builds_listed": [
            (step, name, took * 1e3) for step, name, took in builds.builds[:KERNEL_BUILDS_LISTED]
        ],
        **step_profile(steps),
        **floors,
        # Every step in order, for plots: (seconds, prompt tokens, decode rows, seconds the
        # host waited for the device), and on CUDA also the step's device seconds and the
        # device's idle seconds before it.
        "step_series": [
            (s.seconds, s.prefill_tokens, s.decode_rows, s.wait_s)
            + ((s.device_s, s.idle_s) if clock.enabled else ())
            for s in steps
        ],
        **({} if stacks is None else stack_reports(sampler, steps, stacks)),
    }


def floor_of(
    engine: Engine, workload: Workload, radix: bool, rates: Rates
) -> Callable[[list[Req], list[int]], dict[str, float]]:
    """The floor figures of a run of `workload` on `engine` (bench/common/roofline.py): the
    requests' prompt, cached and output lengths as run, the tokens each step computed;
    with the radix cache, each group decodes over its shared prefix together."""
    shape = ModelShape.of_model(engine.runner.model_config, engine.runner.dtype)
    shared = workload.shared_prefix_len if radix else 0

    def figures(done: list[Req], step_tokens: list[int]) -> dict[str, float]:
        work = [
            RequestWork(
                prompt_len=len(req.origin_input_ids),
                cached_len=req.cached_tokens,
                output_len=len(req.output_ids),
                shared_len=shared,
                sharers=workload.group_size if shared else 1,
            )
            for req in done
        ]
        floor = work_floor(shape, work, rates.matmul, rates.bandwidth, step_tokens)
        return {
            "floor_s": floor.total_s,
            "floor_projections_s": floor.projections_s,
            "floor_prefill_attention_s": floor.prefill_attention_s,
            "floor_decode_attention_s": floor.decode_attention_s,
        }

    return figures


def warmup_requests(workloads: Sequence[Workload]) -> list[BenchRequest]:
    """The first requests of each workload with short outputs: the timed runs then find
    the kernels of their step shapes (prefill beside decode, shared prefixes) compiled."""
    return [
        BenchRequest(r.prompt, min(r.output_len, WARMUP_OUTPUT_LEN))
        for w in workloads
        for r in w.requests[:WARMUP_REQUESTS]
    ]


def bench(
    make_engine: Callable[[bool], Engine],
    workloads: Sequence[Workload],
    radix_modes: list[bool],
    rates: Rates | None = None,
    stacks: tuple[int, int] | None = None,
    stacks_interval_s: float = 0.001,
    repeat: int = 1,
) -> list[dict[str, Any]]:
    """One engine per radix mode (`make_engine(radix)`), every workload on it `repeat`
    times in a row: one row each (`run` its index), read against its floor where the
    device's `rates` are given (and with the host's stacks over steps `stacks`,
    printed)."""
    rows = []
    for radix in radix_modes:
        engine = make_engine(radix)
        try:
            run_offline(engine, warmup_requests(workloads))
            for workload, run in itertools.product(workloads, range(repeat)):
                floor = None if rates is None else floor_of(engine, workload, radix, rates)
                row = {
                    "workload": workload.name,
                    "radix": "on" if radix else "off",
                    "run": run,
                    **run_offline(engine, workload.requests, floor, stacks, stacks_interval_s),
                }
                shown = {k: v for k, v in row.items() if k != "step_series" and "stacks" not in k}
                print(json.dumps(shown), flush=True)
                if stacks:
                    print(f"host stacks over steps {stacks[0]}-{stacks[1]}:", flush=True)
                    print("\n".join(row["host_stacks"]), flush=True)
                    print("of which the slowest on the host:", flush=True)
                    print("\n".join(row["host_stacks_slowest_steps"]), flush=True)
                rows.append(row)
        finally:
            engine.shutdown()
            del engine
            gc.collect()  # its memory must be back before the next engine sizes its pool
    return rows


def _on_and_off(rows: Sequence[dict[str, Any]], key: str) -> dict[str, tuple[float, float]]:
    """Per workload run both ways (with `key`): its value with the radix cache and
    without, the median of each mode's runs."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if key in r:
            by_key.setdefault((r["workload"], r["radix"]), []).append(r[key])
    return {
        name: (statistics.median(values), statistics.median(by_key[(name, "off")]))
        for (name, mode), values in by_key.items()
        if mode == "on" and (name, "off") in by_key
    }


def radix_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per workload run both ways: total throughput with the radix cache over without
    (medians over repeated runs)."""
    return {name: on / off for name, (on, off) in _on_and_off(rows, "total_throughput").items()}


def floor_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per workload run both ways against its floor: the floor without the radix cache
    over the floor with it (the throughput ratio at equal shares of the floors)."""
    return {name: off / on for name, (on, off) in _on_and_off(rows, "floor_s").items()}


def engine_factory(args: argparse.Namespace) -> Callable[[bool], Engine]:
    if args.model is not None:
        model, load_format = str(args.model), "auto"
    else:
        tokenizer = args.tokenizer or default_tokenizer_dir()
        model, load_format = str(write_model_folder(tokenizer, SHAPES[args.shape])), "dummy"
    options: dict[str, Any] = {
        "load_format": load_format,
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "context_length": CONTEXT_LEN,
        **json.loads(args.engine_args),
    }

    def make(radix: bool) -> Engine:
        started = time.perf_counter()
        engine = Engine(model_path=model, disable_radix_cache=not radix, **options)
        config = engine.config
        print(
            f"radix {'on' if radix else 'off'}: engine up in {time.perf_counter() - started:.1f} s"
            f" ({config.max_running_requests} running at most, decode graphs to "
            f"{'none' if engine.runner.graphs is None else engine.runner.graphs.max_bs})"
        )
        return engine

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint (default: dummy)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files (dummy)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    ap.add_argument("--radix", choices=["on", "off", "both"], default="both")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--host-stacks",
        nargs=2,
        type=int,
        default=None,
        metavar=("FIRST", "LAST"),
        help="sample the host's Python stacks over these steps of each run (host_stacks.py)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each workload per engine; ratios are of the modes' medians",
    )
    ap.add_argument(
        "--host-stacks-ms",
        type=float,
        default=1.0,
        help="the sampling interval (a shorter one slows the host more)",
    )
    args = ap.parse_args(argv)
    workloads = [WORKLOADS[name](args.scale, args.seed) for name in args.workloads]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.radix]
    rates = None
    if resolve_device(args.device).type == "cuda":
        rates = Rates.measure()
        torch.cuda.empty_cache()
        print(
            f"{torch.cuda.get_device_name()}: copy bandwidth {rates.bandwidth / 1e12:.2f} TB/s, "
            f"bf16 matmul {rates.matmul / 1e12:.0f} TFLOP/s"
        )
    stacks = None if args.host_stacks is None else (args.host_stacks[0], args.host_stacks[1])
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    rows = bench(
        engine_factory(args),
        workloads,
        modes,
        rates,
        stacks,
        args.host_stacks_ms / 1e3,
        args.repeat,
    )
    ratios = radix_ratios(rows)
    at_floor = floor_ratios(rows)
    if args.json:
        result: dict[str, Any] = {"rows": rows, "radix_on_over_off": ratios}
        if rates is not None:
            result["rates"] = {"matmul": rates.matmul, "bandwidth": rates.bandwidth}
            result["floor_on_over_off"] = at_floor
        args.json.write_text(json.dumps(result, indent=2))
    print(
        f"\n{'workload':<14} {'radix':>5} {'req':>5} {'req/s':>8} {'in tok/s':>10} "
        f"{'out tok/s':>10} {'total tok/s':>11} {'hit rate':>8} {'of floor':>8}"
    )
    for r in rows:
        print(
            f"{r['workload']:<14} {r['radix']:>5} {r['completed']:>5} "
            f"{r['request_throughput']:>8.2f} {r['input_throughput']:>10.0f} "
            f"{r['output_throughput']:>10.0f} {r['total_throughput']:>11.0f} "
            f"{r['cache_hit_rate']:>8.3f} {r.get('of_floor', float('nan')):>8.2f}"
        )
    medians = _on_and_off(rows, "total_throughput")
    for name, ratio in ratios.items():
        floor = at_floor.get(name)
        shown = "" if floor is None else f" (the floors' ratio: {floor:.2f}x)"
        print(f"{name}: radix on / off total throughput {ratio:.2f}x{shown}")
        if args.repeat > 1:
            off = medians[name][1]
            each = [
                r["total_throughput"] / off
                for r in rows
                if (r["workload"], r["radix"]) == (name, "on")
            ]
            print(
                f"  medians of {args.repeat} runs a mode; each radix-on run over the radix-off "
                f"median: {', '.join(f'{x:.2f}x' for x in each)}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
