"""Online serving under load: one stack, `radixserve bench serving` at a ladder of rates.

The stack (NATS, Redis, the six services as `radixserve up` starts them, one worker) is
started once; then, for each request rate, the same workload is sent with Poisson
arrivals (`inf`: all at once) through `/v1/completions`, streamed, and reported as
`radixserve bench serving` reports it: throughput, TTFT, TPOT, ITL and end-to-end
percentiles. Over each rate's phase the worker's own figures come from its /metrics
(steps, their mean time and batch, the share of the phase spent in steps) with every
service's CPU share and this client's, so that a TPOT can be read against the engine's
step time at the batch the load gave, and a client near a whole core is seen to bound
what it measures.

    .venv/bin/python bench/online.py --shape tiny --tokenizer DIR   # a CPU smoke run
    # on a GPU machine: Llama-3.1-8B's shapes, random weights, SmolLM2's tokenizer
    python bench/online.py --device cuda --shape llama-8b --tokenizer DIR \\
        --rates 4 8 16 inf --num-prompts 400
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

from common import PhaseMeter, dummy_model_folder, start_local_stack

from radixserve.benchmark.flags import DATASETS, add_arguments
from radixserve.benchmark.serving import bench
from radixserve.infra import Infra
from radixserve.model_files.paths import resolve_model_path
from radixserve.stack import Stack

WARMUP_PROMPTS = 32  # at rate inf, before the ladder: the kernels of mixed steps compile
SHOWN = (
    ("request_rate", "rate (req/s)", "{}"),
    ("request_throughput", "achieved req/s", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.0f}"),
    ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 ms", "{:.2f}"),
    ("median_e2e_latency_ms", "E2E p50 ms", "{:.0f}"),
    ("worker_step_ms", "worker step ms", "{:.2f}"),
    ("worker_batch", "worker batch", "{:.1f}"),
    ("worker_busy", "worker busy", "{:.2f}"),
    ("client_cpu", "client CPU", "{:.2f}"),
    ("failed", "failed", "{}"),
)


def serving_args(url: str, args: argparse.Namespace, rate: float, prompts: int) -> Any:
    """`radixserve bench serving`'s namespace for one phase."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--base-url", url, "--dataset-name", args.dataset_name]
    argv += ["--num-prompts", str(prompts), "--request-rate", str(rate)]
    argv += ["--seed", str(args.seed), "--warmup-requests", "0", "--flush-cache"]
    argv += ["--disable-tqdm", "--request-timeout-s", str(args.request_timeout_s)]
    argv += ["--random-input-len", str(args.random_input_len)]
    argv += ["--random-output-len", str(args.random_output_len)]
    argv += ["--random-range-ratio", str(args.random_range_ratio)]
    if args.dataset_name == "generated-shared-prefix":
        groups = max(1, prompts // args.gsp_prompts_per_group)
        argv += ["--gsp-num-groups", str(groups)]
        argv += ["--gsp-prompts-per-group", str(args.gsp_prompts_per_group)]
    return parser.parse_args(argv)


def phase(stack: Stack, url: str, metrics_url: str, ns: Any) -> dict[str, Any]:
    """One rate's run: bench serving's summary with the worker's and the client's figures."""
    meter = PhaseMeter(stack, metrics_url)
    started, cpu = time.perf_counter(), time.process_time()
    summary = asyncio.run(bench(ns))
    wall = time.perf_counter() - started
    summary |= meter.report(summary.get("total_output_tokens", 0))
    summary["client_cpu"] = round((time.process_time() - cpu) / wall, 2)
    return summary


def render(rows: list[dict[str, Any]]) -> str:
    lines = []
    for key, label, fmt in SHOWN:
        cells = "".join(f"{fmt.format(row.get(key, '-')):>12}" for row in rows)
        lines.append(f"{label:18}{cells}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument(
        "--shape",
        choices=["llama-8b", "tiny"],
        default=None,
        help="random weights of this shape (load_format dummy) instead of --model",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="its tokenizer (--shape)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--worker-args", default="", help="more worker flags, e.g. '--chunked-prefill-size 4096'"
    )
    ap.add_argument(
        "--rates", nargs="+", type=float, default=[4.0, 8.0, math.inf], help="req/s (inf)"
    )
    ap.add_argument("--num-prompts", type=int, default=200, help="requests at each rate")
    ap.add_argument("--dataset-name", choices=DATASETS, default="sharegpt")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths in [ratio x len, len]"
    )
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18125)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()

    worker_args = ["--device", args.device, *args.worker_args.split()]
    if args.shape is not None:
        if args.tokenizer is None:
            ap.error("--shape needs --tokenizer")
        model_dir = dummy_model_folder(args.tokenizer, args.shape)
        worker_args += ["--load-format", "dummy"]
    else:
        model_dir = resolve_model_path(args.model)

    rows: list[dict[str, Any]] = []
    with Infra() as infra:
        stack = start_local_stack(infra, "online", args.port, model_dir, "bench", worker_args)
        spec = stack.spec
        try:
            stack.wait_healthy(900)
            metrics_url = f"http://127.0.0.1:{spec.metrics_ports()['worker-0']}/metrics"
            warm = serving_args(spec.url, args, math.inf, WARMUP_PROMPTS)
            asyncio.run(bench(warm))
            for rate in args.rates:
                ns = serving_args(spec.url, args, rate, args.num_prompts)
                rows.append(phase(stack, spec.url, metrics_url, ns))
                print(render(rows[-1:]), file=sys.stderr)
        finally:
            stack.stop()

    settings = {"model": args.shape or str(model_dir), "device": args.device}
    settings |= {"dataset": args.dataset_name, "prompts": args.num_prompts}
    settings["worker_args"] = args.worker_args
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    print(json.dumps(settings))
    print(render(rows))
    return 0 if all(row["completed"] == args.num_prompts for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
