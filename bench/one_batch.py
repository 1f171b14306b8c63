"""Prefill and decode latency of one batch, against the device's measured roofline.

Like SGLang's bench_one_batch: a Llama-3.1-8B-shaped model with random bf16 weights is
built on the device (no download: `load_format="dummy"`, the folder holds only
config.json and tokenizer files), then for each batch size B: one prefill of B
prompts of `--input-len` tokens (timed with a device sync), then `--output-len` decode
steps back to back, timed together with one sync at the end (so overlap scheduling
counts, as it does for a client). The same run measures the device's read bandwidth (a large
device-to-device copy) and bf16 matmul rate, and reports each figure as a ratio to
its roofline:

- decode step: (weight bytes + KV bytes read in the step) / bandwidth;
- prefill: matmul FLOPs (2 x params x tokens, plus attention) / matmul rate.

Decode runs with and without CUDA graphs (`--cuda-graph both`, the default; `on` or
`off` for one of them). `--breakdown` adds, per decode step, the host time of each
scheduler phase (plan: slots and retraction; build: the ForwardBatch; launch: the
forward and sampling calls until they return; read: reading the sampled ids, which
waits for them, and bookkeeping) and the device time of the forward (CUDA events
around it). `--profile-bs N` writes the device kernels of a few decode steps at batch
size N (torch.profiler) to `--profile-dir`, with the device's idle time between kernels
and the largest gaps by the kernels around them (from the trace: under the profiler
the host launches the eager kernels between graph replays later than it would
without). Against a tree without CUDA graphs (an older commit on PYTHONPATH) the
decode rows say graphs "n/a".

Under tensor parallelism (`--engine-args '{"tp_size": 2}'`) the figures are rank 0's:
its shard of the weights, KV and heads against one device's roofline.

    python bench/one_batch.py --tokenizer DIR [--batch-sizes 1 8 32 64 --backends triton flashinfer]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    LLAMA_31_8B,
    measure_bandwidth,
    measure_matmul,
    sync,
    write_model_folder,
)


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def graph_modes(requested: str) -> list[bool | None]:
    """disable_cuda_graph values to run: None where the engine has no such option."""
    from radixserve.engine.config import EngineConfig

    if "disable_cuda_graph" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return [None]
    modes: dict[str, list[bool | None]] = {"both": [False, True], "on": [False], "off": [True]}
    return modes[requested]


class PhaseTimer:
    """Host time of the scheduler's phases per step, and device time of the forward."""

    def __init__(self, engine: Any) -> None:
        from radixserve.engine.sched import scheduler as sched_module

        self.samples: dict[str, list[float]] = {}
        sched = engine.scheduler
        self._restore: list[Callable[[], None]] = []
        for name in ("_plan_decode", "_launch", "_read"):
            self._wrap_attr(sched, name, name.strip("_").split("_")[0])
        self._wrap_attr(sched_module, "build_forward_batch", "build")
        self._wrap_forward(engine.runner)

    def _wrap_attr(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.samples.setdefault(label, []).append(time.perf_counter() - t0)

        setattr(owner, name, timed)
        if isinstance(owner, type(sys)):
            self._restore.append(lambda: setattr(owner, name, original))
        else:  # an instance: drop the wrapper, do not leave a bound method (a cycle) there
            self._restore.append(lambda: delattr(owner, name))

    def _wrap_forward(self, runner: Any) -> None:
        original = runner.forward
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def timed(batch: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = original(batch)
            end.record()
            self.samples.setdefault("forward_call", []).append(time.perf_counter() - t0)
            self.events.append((start, end))
            return out

        runner.forward = timed
        self._restore.append(lambda: delattr(runner, "forward"))

    def reset(self) -> None:
        self.samples = {}
        self.events = []

    def medians(self) -> dict[str, float]:
        sync()
        out = {f"{k}_us": statistics.median(v) * 1e6 for k, v in self.samples.items() if v}
        if self.events:
            out["gpu_forward_ms"] = statistics.median(s.elapsed_time(e) for s, e in self.events)
        return out

    def close(self) -> None:
        for restore in self._restore:
            restore()


def host_and_device_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def write_profile(prof: Any, label: str, out_dir: Path) -> None:
    """The host ops by their own CPU time, then the device kernels by theirs."""
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    table += averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"profile_{label}.txt"
    path.write_text(table)
    print(f"profile written to {path}\n{table[:6000]}", flush=True)


def profile_decode(engine: Any, bs: int, input_len: int, label: str, out_dir: Path) -> None:
    """Device kernels of a few decode steps at batch size `bs`, by total time."""
    prompts = [[11 + i] * input_len for i in range(bs)]
    params = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}
    for p in prompts:
        engine.submit(p, params)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    sync()
    with host_and_device_profiler() as prof:
        for _ in range(3):
            engine.step()
        sync()
    while engine.has_work():
        engine.step()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=60
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"trace_{label}_bs{bs}.json"
    prof.export_chrome_trace(str(trace))
    table += "\n" + device_idle(trace, steps=3)
    path = out_dir / f"profile_{label}_bs{bs}.txt"
    path.write_text(table)
    print(f"profile written to {path}\n{table[:3000]}", flush=True)


def device_idle(trace: Path, steps: int, top: int = 12) -> str:
    """From a chrome trace: the device's kernel time and its idle time between the
    first and the last kernel (a step's share of each), and the idle gaps summed by the
    pair of kernels around them, largest first."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:48])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    if not kernels:
        return "no device kernels in the trace\n"
    busy = idle = 0.0
    end = kernels[0][0]
    by_pair: dict[tuple[str, str], list[float]] = {}
    previous = ""
    for start, stop, name in kernels:
        if start > end:
            gap = start - end
            idle += gap
            by_pair.setdefault((previous, name), []).append(gap)
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, previous = stop, name
    lines = [
        f"device over {steps} steps: kernels {busy / steps / 1e3:.3f} ms a step, "
        f"idle between them {idle / steps / 1e3:.3f} ms a step",
        "idle gaps by the kernels around them (us a step, count a step, after -> before):",
    ]
    ranked = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]
    for (after, before), gaps in ranked:
        lines.append(
            f"  {sum(gaps) / steps:8.1f} us  {len(gaps) / steps:6.1f}  {after} -> {before}"
        )
    return "\n".join(lines) + "\n"


def run_backend(
    folder: Path,
    backend: str,
    args: argparse.Namespace,
    bandwidth: float,
    matmul: float,
    disable_cuda_graph: bool | None,
    disable_overlap: bool = False,
) -> list[dict[str, Any]]:
    from radixserve import Engine

    max_bs = max(args.batch_sizes)
    graph_option = {} if disable_cuda_graph is None else {"disable_cuda_graph": disable_cuda_graph}
    graphs_label = "n/a" if disable_cuda_graph is None else ("off" if disable_cuda_graph else "on")
    overlap_label = "off" if disable_overlap else "on"
    if disable_overlap:
        graph_option["disable_overlap_schedule"] = True
    started = time.perf_counter()
    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        attention_backend=backend,
        max_running_requests=max_bs,
        context_length=args.input_len + args.output_len + 8,
        chunked_prefill_size=-1,
        max_prefill_tokens=max_bs * args.input_len + 1,
        disable_radix_cache=True,
        mem_fraction_static=args.mem_fraction_static,
        **graph_option,
        **json.loads(args.engine_args),
    )
    # Kernels some options build in the background (enable_sm90_prefill) are built
    # before anything is timed: the figures are the steady state's.
    if not engine.runner.attn.wait_kernel_builds(args.build_timeout_s):
        raise SystemExit("a background kernel build failed or timed out (see the log)")
    print(
        f"{backend} graphs {graphs_label} overlap {overlap_label}: engine up in {time.perf_counter() - started:.1f} s"
    )
    timer = PhaseTimer(engine) if args.breakdown else None
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = param_count(model)
    c = engine.runner.model_config
    # Per rank under tensor parallelism: its shard of the weights, KV heads and query
    # heads, against one device's bandwidth and matmul rate.
    tp_size = engine.runner.tp.size
    kv_per_token = 2 * c.num_hidden_layers * engine.runner.local_kv_heads * c.head_dim * 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch_sizes:
        prompts = [
            torch.randint(10, c.vocab_size, (args.input_len,), generator=gen).tolist()
            for _ in range(bs)
        ]
        params_d = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        for warm in (True, False):
            rids = [engine.submit(p, params_d) for p in prompts]
            sync()
            if timer is not None:
                timer.reset()
            profiling = not warm and bs in args.profile_prefill_bs
            prof = host_and_device_profiler() if profiling else contextlib.nullcontext()
            with prof:
                t0 = time.perf_counter()
                engine.step()  # the whole batch's prefill (one chunk: no chunking here)
                sync()
                prefill_s = time.perf_counter() - t0
            if profiling:
                write_profile(prof, f"prefill_{backend}_bs{bs}", args.profile_dir)
            if timer is not None:
                timer.reset()  # decode steps only
            # Back to back, one sync at the end: what a client sees between tokens, and
            # what overlap scheduling (host planning step N+1 while the device runs step
            # N) can hide. A sync per step would serialise host and device again.
            num_steps = args.output_len - 1
            t0 = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            sync()
            decode_s = (time.perf_counter() - t0) / num_steps
            breakdown = timer.medians() if timer is not None else {}
            while engine.has_work():
                engine.step()
            assert engine.num_tracked() == 0, rids
            if warm:
                continue
        mean_ctx = args.input_len + args.output_len / 2
        decode_bytes = weight_bytes + bs * mean_ctx * kv_per_token
        decode_roofline = decode_bytes / bandwidth
        tokens = bs * args.input_len
        attn_flops = (
            4
            * c.num_hidden_layers
            * (c.num_attention_heads // tp_size)
            * c.head_dim
            * bs
            * (args.input_len**2 / 2)
        )
        prefill_flops = 2 * params * tokens + attn_flops
        prefill_roofline = prefill_flops / matmul
        rows.append(
            {
                "backend": backend,
                "graphs": graphs_label,
                "overlap": overlap_label,
                "batch_size": bs,
                "input_len": args.input_len,
                "prefill_ms": prefill_s * 1e3,
                "prefill_vs_matmul_rate": prefill_roofline / prefill_s,
                "decode_step_ms": decode_s * 1e3,
                "decode_roofline_ms": decode_roofline * 1e3,
                "decode_x_roofline": decode_s / decode_roofline,
                "decode_tok_s": bs / decode_s,
                **breakdown,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if timer is not None:
        timer.close()
    for profile_bs in args.profile_bs:
        label = f"{backend}_graphs_{graphs_label}"
        profile_decode(engine, profile_bs, args.input_len, label, args.profile_dir)
    engine.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick look")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cuda-graph", choices=["both", "on", "off"], default="both")
    ap.add_argument(
        "--overlap", choices=["both", "on", "off"], default="on", help="overlap scheduling"
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.88,
        help="lower leaves more room for the activations of large prefills (batch >= 128)",
    )
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--build-timeout-s", type=float, default=1200)
    ap.add_argument("--breakdown", action="store_true", help="host/device time per phase")
    ap.add_argument(
        "--profile-bs", type=int, nargs="*", default=[], help="profile decode at these sizes"
    )
    ap.add_argument(
        "--profile-prefill-bs",
        type=int,
        nargs="*",
        default=[],
        help="profile the timed prefill at these sizes (host ops and device kernels)",
    )
    ap.add_argument("--profile-dir", type=Path, default=Path("."))
    args = ap.parse_args()
    shape = dict(LLAMA_31_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    bandwidth = measure_bandwidth()
    matmul = measure_matmul()
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    print(
        f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s"
    )
    folder = write_model_folder(args.tokenizer, shape)
    rows = []
    for backend in args.backends:
        for disable in graph_modes(args.cuda_graph):
            for no_overlap in {"both": [False, True], "on": [False], "off": [True]}[args.overlap]:
                rows += run_backend(folder, backend, args, bandwidth, matmul, disable, no_overlap)
                gc.collect()  # the last engine's memory must be back before the next one
                torch.cuda.empty_cache()
    result = {
        "device": device,
        "torch": torch.__version__,
        "bandwidth_bytes_s": bandwidth,
        "matmul_flop_s": matmul,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(
        f"\n{'backend':<10} {'graphs':>6} {'ovl':>3} {'bs':>4} {'prefill ms':>10} {'vs matmul':>9} "
        f"{'decode ms':>9} {'roofline':>8} {'x roof':>6}"
    )
    for r in rows:
        print(
            f"{r['backend']:<10} {r['graphs']:>6} {r.get('overlap', '-'):>3} {r['batch_size']:>4} "
            f"{r['prefill_ms']:>10.1f} "
            f"{r['prefill_vs_matmul_rate']:>9.2f} {r['decode_step_ms']:>9.2f} "
            f"{r['decode_roofline_ms']:>8.2f} {r['decode_x_roofline']:>6.2f}"
        )
    if args.breakdown:
        print(f"\n{'backend':<10} {'graphs':>6} {'bs':>4}  decode step phases (median)")
        for r in rows:
            phases = "  ".join(
                f"{k}={r[k]:.0f}" if k.endswith("_us") else f"{k}={r[k]:.2f}"
                for k in (
                    "plan_us",
                    "build_us",
                    "launch_us",
                    "forward_call_us",
                    "read_us",
                    "gpu_forward_ms",
                )
                if k in r
            )
            print(
                f"{r['backend']:<10} {r['graphs']:>6} {r.get('overlap', '-'):>3} "
                f"{r['batch_size']:>4}  {phases}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
