"""Does capturing more CUDA graphs slow the replay of the decode graphs? A probe.

On an H100 (docs/performance.md, "The quick suite with the prefill pieces; what the
pieces cost decode") a decode step got 1-2% slower once the prefill pieces were captured
in the process, with the same kernels: the GPU idled between the decode graph's kernels
(~0.12 ms a step at batch 64). It stayed slow after the pieces were freed, and a second
engine in a process was slow without pieces. This probe asks what the slowdown follows,
one engine per process (8B shape, random bf16 weights, `auto` attention, the pieces off
unless `--pieces`):

1. the decode step at `--batch` (back-to-back steps, overlap on) and the GPU's idle time
   inside the steps (profiler CUDA activity: busy time against the span);
2. after capturing `--graphs` dummy graphs of `--nodes` small kernels each on a side
   stream (kept alive, or freed with `--free`), the same again.

Runs at `--graphs` 0, 1, 10, 100 and 330 tell whether the number of captured
graphs, or of their kernels, matters; `--max-bs 512` against 64 whether a serving
engine's own decode graphs (a graph per size to 512) already put it in the slow state;
`--no-pdl` whether it needs the programmatic dependent launches in the decode graphs
(every Triton kernel then launches plainly, as off Hopper); `--when start` whether a
capture made before the engine's first step (its decode graphs captured, never yet
replayed) slows them too (a run at `--graphs 0` is its control); `--pieces 512 --when
start --graphs 0` whether the engine's own start-up (the prefill pieces, then the decode
graphs, on one stream) keeps the decode graphs fast. The slow state turned out to be the
programmatic launches lost (docs/performance.md, 2026-11-28).

    python lab/probes/graph_gaps.py --tokenizer DIR --graphs 10 --nodes 30 [--what pdl-capture]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from common import LLAMA_31_8B, dummy_engine, write_model_folder  # noqa: E402


def decode_steps(engine: Any, steps: int) -> float:
    """Mean wall time of `steps` engine steps (ms), one sync at the end."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def idle_per_step(engine: Any, steps: int) -> tuple[float, float, int]:
    """(busy ms, idle ms, kernel boundaries with a gap) per step, from CUDA activity."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy = idle = 0.0
    gaps = 0
    end = spans[0][0]
    for start, stop in spans:
        if start > end:
            idle += start - end
            gaps += 1
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / steps / 1e3, idle / steps / 1e3, gaps // steps


def triton_add(pdl: bool) -> Any:
    """x += 1 as a Triton kernel (one program of 4096), launched as a programmatic
    dependent with `pdl`: a dummy like the decode graph's own kernels."""
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, PDL: tl.constexpr) -> None:
        offs = tl.arange(0, 4096)
        if PDL:
            tl.extra.cuda.gdc_wait()
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    def add(x: torch.Tensor) -> None:
        _add_one[(1,)](x, PDL=pdl, launch_pdl=pdl)

    return add


def capture_dummies(
    graphs: int, nodes: int, raw: bool, stream: Any = None, pool: Any = None, kernel: Any = None
) -> list[torch.cuda.CUDAGraph]:
    """`graphs` graphs of `nodes` elementwise kernels each, in their own memory pool.

    `raw` captures with `capture_begin`/`capture_end` on the side stream, without what
    `torch.cuda.graph` does first (synchronize, empty the device and pinned-host caches).
    `kernel(x)` instead of torch's `x.add_(1.0)`: `triton_add`'s.
    """
    x = torch.zeros(4096, device="cuda")
    add = kernel or (lambda t: t.add_(1.0))
    add(x)  # built (a Triton kernel) before any capture
    torch.cuda.synchronize()
    stream = stream or torch.cuda.Stream()
    pool = pool or torch.cuda.graph_pool_handle()
    out = []
    for _ in range(graphs):
        graph = torch.cuda.CUDAGraph()
        if raw:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.capture_begin(pool)
                for _ in range(nodes):
                    add(x)
                graph.capture_end()
        else:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                for _ in range(nodes):
                    add(x)
        out.append(graph)
    torch.cuda.synchronize()
    return out


def disturb(engine: Any, what: str, graphs: int, nodes: int) -> list[torch.cuda.CUDAGraph]:
    """Do `what` between the two measurements; the graphs it captured (keep them alive)."""
    decode = engine.runner.graphs
    if what in ("same-stream", "same-pool", "same-both"):
        stream = decode.capture_stream if what != "same-pool" else None
        pool = decode.capture_pool if what != "same-stream" else None
        return capture_dummies(graphs, nodes, False, stream, pool)
    if what in ("new-stream", "capture-stream"):  # no capture: a kernel run on a stream,
        # a new one or the decode graphs' capture stream
        stream = torch.cuda.Stream() if what == "new-stream" else decode.capture_stream
        with torch.cuda.stream(stream):
            torch.zeros(4096, device="cuda").add_(1.0)
        torch.cuda.synchronize()
        return []
    if what == "empty-cache":  # what torch.cuda.graph does before a capture, part 1
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return []
    if what == "host-empty-cache":  # part 2: the pinned host memory cache
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
        return []
    if what in ("triton-capture", "pdl-capture"):
        return capture_dummies(graphs, nodes, False, kernel=triton_add(what == "pdl-capture"))
    return capture_dummies(graphs, nodes, raw=what == "raw-capture")


def refresh(engine: Any, how: str) -> None:
    """Try to undo the slowdown: upload every decode graph again to the stream that replays
    them (driver `cuGraphUpload`), or capture the decode graphs again."""
    decode = engine.runner.graphs
    if how == "upload":
        import ctypes

        libcuda = ctypes.CDLL("libcuda.so.1")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for graph in decode._graphs.values():
            rc = libcuda.cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()), stream)
            if rc != 0:
                raise RuntimeError(f"cuGraphUpload failed: {rc}")
    elif how == "recapture":
        decode._graphs.clear()
        decode._capture_all()
    torch.cuda.synchronize()


def no_programmatic_launch() -> None:
    """Launch every Triton kernel plainly (as off Hopper): the modules that took
    `programmatic_launch` by name, and `few_token_dependent` through common's."""
    from radixserve.engine.attention.triton_ops import common, decode, shared_prefix
    from radixserve.engine.kernels.triton_ops import gemv

    for module in (common, decode, shared_prefix, gemv):
        module.programmatic_launch = lambda device: False  # type: ignore[attr-defined]


def measure(engine: Any, label: str, reps: int) -> dict[str, Any]:
    walls = [decode_steps(engine, 20) for _ in range(reps)]
    busy, idle, gaps = idle_per_step(engine, 10)
    row = {"label": label, "step_ms": statistics.median(walls), "busy_ms": busy}
    row |= {"idle_ms": idle, "gaps_per_step": gaps}
    print(
        f"{label:<28} step {row['step_ms']:.3f} ms  busy {busy:.3f}  idle {idle:.3f}  "
        f"gaps/step {gaps}",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-bs", type=int, default=64, help="decode graphs up to this size")
    ap.add_argument("--graphs", type=int, default=330, help="dummy graphs captured after")
    ap.add_argument("--nodes", type=int, default=30, help="kernels in each dummy graph")
    ap.add_argument("--free", action="store_true", help="free the dummies before timing")
    ap.add_argument(
        "--what",
        choices=(
            "capture",
            "raw-capture",
            "empty-cache",
            "host-empty-cache",
            "same-stream",
            "same-pool",
            "same-both",
            "triton-capture",
            "pdl-capture",
            "new-stream",
            "capture-stream",
        ),
        default="capture",
        help="between the measurements: capture the dummies (torch.cuda.graph), capture "
        "them without its cache emptying, only empty the device or pinned-host cache, "
        "capture them on the decode graphs' stream, memory pool or both, or capture "
        "dummies of a Triton kernel launched plainly or as a programmatic dependent; or "
        "only run a kernel on a new stream or on the decode graphs' capture stream",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pieces", type=int, default=0, help="prefill pieces up to these tokens")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch")
    ap.add_argument(
        "--when",
        choices=("between", "start"),
        default="between",
        help="disturb between the two measurements, or once the engine is up, before its "
        "first step (then one measurement)",
    )
    ap.add_argument(
        "--then",
        choices=("upload", "recapture", "new-stream"),
        help="afterwards, upload the decode graphs again, capture them again, or run the "
        "steps on a stream created then, and time",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("lab/probes/graph_gaps.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.no_pdl:
        no_programmatic_launch()
    folder = write_model_folder(args.tokenizer, dict(LLAMA_31_8B))
    engine = dummy_engine(
        folder,
        "cuda",
        "auto",
        max_running_requests=max(args.batch, args.max_bs),
        cuda_graph_max_bs=args.max_bs,
        context_length=2048,
        chunked_prefill_size=-1,
        disable_radix_cache=True,
        piecewise_cuda_graph_max_tokens=args.pieces,
    )
    label = f"+{args.graphs} graphs x {args.nodes}"
    if args.what != "capture":
        plain = "cache" in args.what or args.what in ("new-stream", "capture-stream")
        label = args.what if plain else f"{label} {args.what}"
    pdl = " (no PDL)" if args.no_pdl else ""
    early = args.when == "start"
    # Captured before any request: the decode graphs have not been replayed yet.
    dummies = disturb(engine, args.what, args.graphs, args.nodes) if early else []
    steps_needed = 12 + (20 * args.reps + 10) * 3 + 20
    params = {"max_new_tokens": steps_needed, "ignore_eos": True, "temperature": 0}
    for i in range(args.batch):
        engine.submit([11 + i] * 512, params)
    for _ in range(12):  # the prefill and the first decode steps
        engine.step()
    if early:
        measure(engine, f"decode graphs to {args.max_bs}{pdl}, {label} at start", args.reps)
        engine.shutdown()
        return 0
    measure(engine, f"decode graphs to {args.max_bs}{pdl}", args.reps)
    dummies = disturb(engine, args.what, args.graphs, args.nodes)
    if args.free:
        dummies.clear()
        gc.collect()
        torch.cuda.empty_cache()
        label += " (freed)"
    measure(engine, label, args.reps)
    if args.then == "new-stream":  # every later step on a stream created now
        with torch.cuda.stream(torch.cuda.Stream()):
            measure(engine, "then on a new stream", args.reps)
    elif args.then:
        refresh(engine, args.then)
        measure(engine, f"then {args.then}", args.reps)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
