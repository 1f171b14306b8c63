"""Time to first token in the in-process engine, one request at a time, step by step.

Llama-3.1-8B's shapes with random weights (`load_format dummy`, no download), one engine
per setting. For each prompt length, `--reps` requests one after the other (random
tokens, so nothing is cached), each submitted and then stepped (`Engine.step`) until its
first token comes back. Reported per length: TTFT (submit -> the step that returns the
token), how many steps that took and each one's host time, and the prefill step on the
device (CUDA events around the first step: what TTFT cannot be below). `--profile`
prints torch.profiler's top host and device rows over one request at the first length.

    python bench/ttft.py --tokenizer DIR [--input-lens 128 512 2048 --overlap both]
    python bench/ttft.py --tokenizer DIR --device cpu --shape tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import SHAPES, dummy_engine, write_model_folder  # noqa: E402

from radixserve import Engine  # noqa: E402


def one_request(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """Submit, step until the first token: TTFT, each step's host ms, the first step's
    device ms (CUDA; on the CPU its host ms). Then run the request out (two tokens) so
    the next starts from idle."""
    params = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}
    cuda = engine.runner.device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    _sync(cuda)
    t0 = time.perf_counter()
    rid = engine.submit(prompt, params)
    steps: list[float] = []
    ttft = None
    while ttft is None:
        s0 = time.perf_counter()
        if not steps and events:
            events[0].record()
        outs = engine.step()
        if not steps and events:
            events[1].record()
        steps.append(1e3 * (time.perf_counter() - s0))
        if any(o.rid == rid and o.new_token_ids for o in outs):
            ttft = 1e3 * (time.perf_counter() - t0)
        if len(steps) > 50:
            raise RuntimeError("no first token after 50 steps")
    while engine.has_work():
        engine.step()
    engine.forget(rid)
    _sync(cuda)
    device_ms = events[0].elapsed_time(events[1]) if events else steps[0]
    return {"ttft_ms": ttft, "steps_ms": steps, "first_step_device_ms": device_ms}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(engine: Engine, lens: list[int], reps: int, gen: torch.Generator) -> list[dict]:
    vocab = engine.runner.model_config.vocab_size
    rows = []
    for length in lens:
        runs = []
        for _ in range(reps + 2):  # the first two warm this length's kernels
            prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
            runs.append(one_request(engine, prompt))
        runs = runs[2:]
        most = statistics.mode(len(r["steps_ms"]) for r in runs)
        same = [r for r in runs if len(r["steps_ms"]) == most]
        rows.append(
            {
                "input_len": length,
                "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                "steps": most,
                "step_host_ms": [
                    round(statistics.median(r["steps_ms"][i] for r in same), 3) for i in range(most)
                ],
                "first_step_device_ms": statistics.median(r["first_step_device_ms"] for r in runs),
            }
        )
    return rows


def profile(engine: Engine, length: int, gen: torch.Generator) -> None:
    """The host's Python functions over one request (cProfile), then torch.profiler's
    host and device rows over another."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    vocab = engine.runner.model_config.vocab_size
    prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
    with cProfile.Profile() as prof:
        one_request(engine, prompt)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        one_request(engine, prompt)
    table = tprof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--input-lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="tiny: a CPU smoke run"
    )
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    folder = write_model_folder(args.tokenizer, dict(SHAPES[args.shape]))
    settings = {"on": [False], "off": [True], "both": [False, True]}[args.overlap]
    results = []
    for disable_overlap in settings:
        started = time.perf_counter()
        engine = dummy_engine(
            folder,
            args.device,
            args.backend,
            disable_overlap_schedule=disable_overlap,
            **json.loads(args.engine_args),
        )
        ready_s = time.perf_counter() - started
        gen = torch.Generator().manual_seed(0)
        rows = measure(engine, args.input_lens, args.reps, gen)
        overlap = "off" if disable_overlap else "on"
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(
            f"\n{name}, overlap {overlap}, backend {args.backend}, engine ready in {ready_s:.1f} s"
        )
        print(f"{'input':>6} {'TTFT ms':>8} {'prefill dev ms':>14} steps: host ms each")
        for row in rows:
            row["overlap"] = overlap
            print(
                f"{row['input_len']:>6} {row['ttft_ms']:8.2f} {row['first_step_device_ms']:14.2f}"
                f" {row['steps']}: {row['step_host_ms']}"
            )
        results += rows
        if args.profile:
            profile(engine, args.input_lens[0], gen)
        engine.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
