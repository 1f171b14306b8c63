"""Time to first token of one long prompt, FlashInfer's SM90 prefill kernels on and off.

The engine as served (chunked prefill of 2048 tokens, the `auto` attention backend) on
a Llama-3.1-8B-shaped model with random bf16 weights built on the device (as
bench/one_batch.py): one prompt of `--input-lens` random token ids at a time, one
output token; the time from submit to that token (its last step synced). With
`--decoders N` (a list; 0 = an idle server) N requests of 512-token prompts are
decoding when the long prompt arrives, so its chunks run in mixed batches beside them;
they are aborted after each prompt. Each setting is an engine of its own, built in the
order on, off, on, off (a device's first runs are its fastest); the SM90 engine waits
for its kernels' background build before it is timed. Median of `--reps` prompts per
case and engine; the table gives each setting's median over its engines and off / on.

    python lab/probes/long_prompt.py --tokenizer DIR [--input-lens 2048 8192 32768 --decoders 0 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import LLAMA_31_8B, sync, write_model_folder  # noqa: E402

Case = tuple[int, int]  # (requests decoding meanwhile, prompt tokens)


def start_decoders(engine: Any, n: int, prompt: Callable[[int], list[int]]) -> list[str]:
    """`n` requests decoding (each has its first token) when this returns."""
    params = {"max_new_tokens": 2048, "ignore_eos": True, "temperature": 0}
    rids = [engine.submit(prompt(512), params) for _ in range(n)]
    started: set[str] = set()
    while len(started) < n:
        started |= {out.rid for out in engine.step()}
    return rids


def stop_decoders(engine: Any, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()


def time_to_first_token(engine: Any, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` to its one output token (whatever else runs
    meanwhile goes on running)."""
    sync()
    started = time.perf_counter()
    rid = engine.submit(prompt, {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0})
    done = False
    while not done:
        done = any(out.rid == rid and out.finished for out in engine.step())
    sync()
    return time.perf_counter() - started


def run_engine(folder: Path, sm90: bool, args: argparse.Namespace) -> dict[Case, float]:
    from radixserve import Engine

    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        context_length=max(args.input_lens) + 8,
        max_running_requests=max(args.decoders) + 8,
        cuda_graph_max_bs=max(args.decoders) + 8,
        enable_sm90_prefill=sm90,
    )
    vocab = engine.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    def warm_up() -> None:  # every kernel the cases run, compiled before timing
        background = start_decoders(engine, max(args.decoders), prompt)
        for n in args.input_lens:
            time_to_first_token(engine, prompt(n))
        stop_decoders(engine, background)

    warm_up()
    if sm90:
        started = time.perf_counter()
        if not engine.runner.attn.wait_kernel_builds(args.build_timeout_s):
            raise SystemExit("the SM90 prefill kernels did not build (see the log)")
        print(f"SM90 prefill kernels ready after a further {time.perf_counter() - started:.0f} s")
        warm_up()
    medians: dict[Case, float] = {}
    for decoders in args.decoders:
        for n in args.input_lens:
            times = []
            for _ in range(args.reps):
                engine.flush_cache()
                background = start_decoders(engine, decoders, prompt)
                times.append(time_to_first_token(engine, prompt(n)))
                stop_decoders(engine, background)
            medians[decoders, n] = statistics.median(times)
            print(
                f"sm90 {'on ' if sm90 else 'off'} {decoders:3d} decoding, {n:6d} tokens: "
                f"TTFT {medians[decoders, n] * 1e3:8.1f} ms"
            )
    engine.shutdown()
    return medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--decoders", type=int, nargs="+", default=[0, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--order", nargs="+", choices=["on", "off"], default=["on", "off", "on", "off"])
    ap.add_argument("--build-timeout-s", type=float, default=1200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    folder = write_model_folder(args.tokenizer, dict(LLAMA_31_8B))
    runs: dict[str, list[dict[Case, float]]] = {"on": [], "off": []}
    for setting in args.order:
        runs[setting].append(run_engine(folder, setting == "on", args))
        gc.collect()  # the last engine's memory must be back before the next one
        torch.cuda.empty_cache()
    nan = float("nan")
    rows = []
    for decoders in args.decoders:
        for n in args.input_lens:
            case = (decoders, n)
            on = statistics.median(r[case] for r in runs["on"]) if runs["on"] else nan
            off = statistics.median(r[case] for r in runs["off"]) if runs["off"] else nan
            rows.append(
                {
                    "decoders": decoders,
                    "input_len": n,
                    "ttft_on_ms": on * 1e3,
                    "ttft_off_ms": off * 1e3,
                }
            )
    print(f"\n{torch.cuda.get_device_name()}")
    print(f"{'decoding':>8} {'tokens':>7} {'SM90 on ms':>11} {'off ms':>9} {'off / on':>8}")
    for r in rows:
        print(
            f"{r['decoders']:>8} {r['input_len']:>7} {r['ttft_on_ms']:>11.1f} "
            f"{r['ttft_off_ms']:>9.1f} {r['ttft_off_ms'] / r['ttft_on_ms']:>8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
