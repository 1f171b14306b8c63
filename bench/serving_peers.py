"""The side by side as a benchmark: one server, the same client at a ladder of rates, one table.

The server is radixserve's stack, started here as bench/online.py starts it (NATS, Redis,
the six services, one worker), or any OpenAI-compatible server already running, given by
`--url` (vLLM, SGLang, another radixserve: ../shared/peers/vllm.md brings vLLM to the lent
GPU machine). After a warm-up at rate inf, each rate of the ladder (default 4, 8, 16, 32,
inf req/s) sends the same workload with Poisson arrivals through `radixserve bench
serving`'s client (streamed `/v1/completions`, EOS ignored), a fresh seed a rate so that
no rate reuses another's prompts from a prefix cache. Every flag this script does not
know is a `radixserve bench serving` flag and goes to it (`--dataset-name random
--random-input-len 512 --dataset-path FILE --goodput ttft:30 ...`).

Writes one Markdown table (TTFT, TPOT and ITL p50 / p99, output tok/s by rate) and the
rows as JSON (each rate's whole `bench serving` summary); `--against` earlier runs' JSON
puts their rows in the same table, rate by rate, for the side by side.

    # a CPU smoke run: the embedded model, two rates
    .venv/bin/python bench/serving_peers.py --rates 4 inf --num-prompts 8 \\
        --random-input-len 64 --random-output-len 8
    # a lent H200: radixserve's stack, then vLLM on the same workload, one table
    python bench/serving_peers.py --device cuda --shape llama-8b --tokenizer DIR \\
        --label radixserve --json out/radixserve.json --dataset-name random \\
        --random-input-len 512 --random-output-len 256
    python bench/serving_peers.py --url http://127.0.0.1:8001 --label vllm --tokenizer DIR \\
        --json out/vllm.json --against out/radixserve.json --markdown out/peers.md \\
        --dataset-name random --random-input-len 512 --random-output-len 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import dummy_model_folder, start_local_stack

from radixserve.benchmark.flags import add_arguments
from radixserve.benchmark.serving import bench
from radixserve.infra import Infra
from radixserve.model_files.paths import resolve_model_path

COLUMNS = (
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.0f}"),
    ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.2f}"),
    ("median_itl_ms", "ITL p50 ms", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 ms", "{:.2f}"),
    ("request_goodput", "goodput req/s", "{:.2f}"),
    ("failed", "failed", "{}"),
)
OWNED = ("--base-url", "--request-rate", "--warmup-requests")  # bench serving's, set here


def serving_namespace(
    url: str, forwarded: list[str], rate: float, prompts: int, seed: int, warmup: int
) -> argparse.Namespace:
    """`radixserve bench serving`'s namespace for one rate (the flags set here come last)."""
    parser = argparse.ArgumentParser(prog="radixserve bench serving")
    add_arguments(parser)
    argv = [*forwarded, "--base-url", url, "--request-rate", str(rate)]
    argv += ["--num-prompts", str(prompts), "--seed", str(seed)]
    argv += ["--warmup-requests", str(warmup), "--disable-tqdm"]
    return parser.parse_args(argv)


def wait_for_models(url: str, timeout_s: float) -> None:
    """Until the server lists a model (its warm-up request then proves it answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{url}/v1/models", timeout=5)
            if response.status_code == 200 and response.json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} listed no model within {timeout_s:.0f} s")
        time.sleep(1)


def ladder(url: str, args: argparse.Namespace, forwarded: list[str]) -> list[dict[str, Any]]:
    if args.warmup_prompts:
        warm = serving_namespace(url, forwarded, math.inf, args.warmup_prompts, args.seed - 1, 1)
        asyncio.run(bench(warm))
    rows = []
    for i, rate in enumerate(args.rates):
        ns = serving_namespace(url, forwarded, rate, args.num_prompts, args.seed + i, 0)
        rows.append(asyncio.run(bench(ns)))
        print(render_markdown([(args.label, rows[-1:])]), file=sys.stderr)
    return rows


def _rate_order(row: dict[str, Any]) -> float:
    rate = row["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def render_markdown(runs: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """One table: a line per rate and server, servers in the order given within a rate."""
    lines = ["| rate (req/s) | server | " + " | ".join(label for _, label, _ in COLUMNS) + " |"]
    lines.append("| --- " * (len(COLUMNS) + 2) + "|")
    flat = [(label, row) for label, rows in runs for row in rows]
    for label, row in sorted(flat, key=lambda lr: _rate_order(lr[1])):  # stable: run order
        cells = [str(row["request_rate"]), label]
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # bench serving's --model is not this script's --model-path
    )
    ap.add_argument("--url", default=None, help="a running OpenAI-compatible server")
    ap.add_argument("--label", default=None, help="the server's name in the table")
    ap.add_argument("--model-path", default=None, help="the stack's model (default: embedded)")
    ap.add_argument(
        "--shape",
        choices=["llama-8b", "tiny"],
        default=None,
        help="the stack: random weights of this shape (load_format dummy), --tokenizer's files",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="also sent to bench serving")
    ap.add_argument("--device", default="cpu", help="the stack's worker device")
    ap.add_argument("--worker-args", default="", help="more worker flags for the stack")
    ap.add_argument("--port", type=int, default=18225, help="the stack's gateway port")
    ap.add_argument("--rates", nargs="+", type=float, default=[4.0, 8.0, 16.0, 32.0, math.inf])
    ap.add_argument("--num-prompts", type=int, default=480, help="requests at each rate")
    ap.add_argument("--warmup-prompts", type=int, default=32, help="at rate inf, not counted")
    ap.add_argument("--seed", type=int, default=1, help="rate i uses seed + i")
    ap.add_argument("--wait-s", type=float, default=900.0, help="for the server to be ready")
    ap.add_argument("--json", type=Path, default=None, help="write this run's rows here")
    ap.add_argument("--against", type=Path, nargs="*", default=[], help="earlier runs' --json")
    ap.add_argument("--markdown", type=Path, default=None, help="write the table here")
    args, forwarded = ap.parse_known_args()
    if owned := [flag for flag in forwarded if flag.split("=")[0] in OWNED]:
        ap.error(f"{' '.join(owned)}: set by this script (--url, --rates, --warmup-prompts)")
    if args.tokenizer is not None:
        forwarded += ["--tokenizer", str(args.tokenizer)]
    serving_namespace("http://x", forwarded, 1.0, 1, 0, 0)  # a bad flag fails here, not later
    args.label = args.label or ("radixserve" if args.url is None else args.url)

    if args.url is not None:
        wait_for_models(args.url, args.wait_s)
        rows = ladder(args.url, args, forwarded)
        server: dict[str, Any] = {"url": args.url}
    else:
        rows, server = run_own_stack(args, forwarded, ap)

    settings = {"label": args.label, **server, "num_prompts": args.num_prompts}
    settings |= {"rates": [str(rate) for rate in args.rates], "bench_serving_args": forwarded}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    runs = [(args.label, rows)]
    for path in args.against:
        earlier = json.loads(path.read_text())
        runs.append((earlier["settings"]["label"], earlier["rows"]))
    table = render_markdown(runs)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    print(json.dumps(settings))
    print(table)
    return 0 if all(row["completed"] == args.num_prompts for row in rows) else 1


def run_own_stack(
    args: argparse.Namespace, forwarded: list[str], ap: argparse.ArgumentParser
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    worker_args = ["--device", args.device, *args.worker_args.split()]
    if args.shape is not None:
        if args.tokenizer is None:
            ap.error("--shape needs --tokenizer")
        model_dir = dummy_model_folder(args.tokenizer, args.shape)
        worker_args += ["--load-format", "dummy"]
    else:
        model_dir = resolve_model_path(args.model_path)
    with Infra() as infra:
        stack = start_local_stack(infra, "peers", args.port, model_dir, "bench", worker_args)
        try:
            stack.wait_healthy(args.wait_s)
            rows = ladder(stack.spec.url, args, forwarded)
        finally:
            stack.stop()
    server = {"model": args.shape or str(model_dir), "device": args.device}
    return rows, server | {"worker_args": args.worker_args}


if __name__ == "__main__":
    raise SystemExit(main())
