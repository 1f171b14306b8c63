"""Time to first token of one long prompt, FlashInfer's SM90 prefill kernels on and off.

The engine as served (chunked prefill of 2048 tokens, the `auto` attention backend) on
a Llama-3.1-8B-shaped model with random bf16 weights built on the device (as
bench/one_batch.py), an idle server: one prompt of `--input-lens` random token ids at a
time, one output token; the time from submit to that token (its last step synced).
Each setting is an engine of its own, built in the order on, off, on, off (a device's
first runs are its fastest); the SM90 engine waits for its kernels' background build
before it is timed. Median of `--reps` prompts per length and engine; the table gives
each setting's median over its engines and off / on.

    python bench/long_prompt.py --tokenizer DIR [--input-lens 2048 8192 32768]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from one_batch import LLAMA_31_8B, sync, write_model_folder


def time_to_first_token(engine: Any, prompt: list[int]) -> float:
    sync()
    started = time.perf_counter()
    engine.submit(prompt, {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0})
    while engine.has_work():
        engine.step()
    sync()
    return time.perf_counter() - started


def run_engine(folder: Path, sm90: bool, args: argparse.Namespace) -> dict[int, float]:
    from radixserve import Engine

    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        context_length=max(args.input_lens) + 8,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        disable_sm90_prefill=not sm90,
    )
    vocab = engine.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    for n in args.input_lens:  # FA2's (and Triton's) kernels compiled before timing
        time_to_first_token(engine, prompt(n))
    if sm90:
        started = time.perf_counter()
        if not engine.runner.attn.wait_kernel_builds(args.build_timeout_s):
            raise SystemExit("the SM90 prefill kernels did not build (see the log)")
        print(f"SM90 prefill kernels ready after a further {time.perf_counter() - started:.0f} s")
        for n in args.input_lens:
            time_to_first_token(engine, prompt(n))
    medians = {}
    for n in args.input_lens:
        times = []
        for _ in range(args.reps):
            engine.flush_cache()
            times.append(time_to_first_token(engine, prompt(n)))
        medians[n] = statistics.median(times)
        print(f"sm90 {'on ' if sm90 else 'off'} {n:6d} tokens: TTFT {medians[n] * 1e3:8.1f} ms")
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--order", nargs="+", default=["on", "off", "on", "off"])
    ap.add_argument("--build-timeout-s", type=float, default=1200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    folder = write_model_folder(args.tokenizer, dict(LLAMA_31_8B))
    runs: dict[str, list[dict[int, float]]] = {"on": [], "off": []}
    for setting in args.order:
        runs[setting].append(run_engine(folder, setting == "on", args))
    rows = []
    for n in args.input_lens:
        on = statistics.median(r[n] for r in runs["on"]) if runs["on"] else float("nan")
        off = statistics.median(r[n] for r in runs["off"]) if runs["off"] else float("nan")
        rows.append({"input_len": n, "ttft_on_ms": on * 1e3, "ttft_off_ms": off * 1e3})
    print(f"\n{torch.cuda.get_device_name()}")
    print(f"{'tokens':>7} {'SM90 on ms':>11} {'off ms':>9} {'off / on':>8}")
    for r in rows:
        ratio = r["ttft_off_ms"] / r["ttft_on_ms"]
        print(
            f"{r['input_len']:>7} {r['ttft_on_ms']:>11.1f} {r['ttft_off_ms']:>9.1f} {ratio:>8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
