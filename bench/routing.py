"""Cache-aware against least-load routing over several workers, in one run.

The same stack (NATS, Redis, the six services as `radixserve up` starts them, N workers)
is started once per routing policy, with the scheduler's `--routing` set, and loaded
with `radixserve bench serving`'s generated-shared-prefix workload (groups of prompts
sharing a system prompt). Reported per policy: the cache hit rate (cached / prompt
tokens, from the responses' `cached_tokens`), throughput and latency percentiles.
Least-load routing spreads a group over the workers, and each of them computes its
system prompt; cache-aware routing sends a group to the worker holding it.

    .venv/bin/python bench/routing.py                      # embedded SmolLM2 on the CPU
    .venv/bin/python bench/routing.py --groups 4 --per-group 4 --output-len 8   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve.benchmark.flags import add_arguments
from radixserve.benchmark.serving import bench
from radixserve.infra import Infra
from radixserve.model_files.paths import resolve_model_path
from radixserve.routing import ROUTING_POLICIES
from radixserve.stack import Stack, StackSpec

SHOWN = (
    "cache_hit_rate",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_e2e_latency_ms",
    "completed",
    "failed",
)


def load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(
        [
            "--base-url",
            url,
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            str(args.groups),
            "--gsp-prompts-per-group",
            str(args.per_group),
            "--gsp-system-prompt-len",
            str(args.system_len),
            "--gsp-question-len",
            str(args.question_len),
            "--gsp-output-len",
            str(args.output_len),
            "--max-concurrency",
            str(args.concurrency),
            "--warmup-requests",
            "0",
            "--flush-cache",
            "--disable-tqdm",
            "--seed",
            str(args.seed),
        ]
    )
    return asyncio.run(bench(ns))


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    with Infra() as infra:
        spec = StackSpec(
            nats_url=infra.nats_url,
            redis_url=infra.redis_url,
            subject_prefix=f"bench-{policy.replace('_', '-')}",
            host="127.0.0.1",
            port=args.port,
            workers=args.workers,
            model_dir=model_dir,
            served_model_name="bench",
            worker_args=["--device", args.device],
            tokenizer_args=[],
            log_dir=Path(tempfile.mkdtemp(prefix=f"radixserve-routing-{policy}-")),
            extra_args={"scheduler": ["--routing", policy]},
        )
        stack = Stack(spec, say=lambda text: print(text, file=sys.stderr))
        stack.start()
        try:
            stack.wait_healthy(600)  # one worker ready: wait for all of them
            while httpx.get(f"{spec.url}/health", timeout=5).json().get("workers_ready") != (
                args.workers
            ):
                stack.supervise_once()
                time.sleep(0.5)
            return load(spec.url, args)
        finally:
            stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=18124)
    parser.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    results = {policy: run_policy(policy, args, model_dir) for policy in args.policies}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{'':24}" + "".join(f"{p:>14}" for p in results))
    for key in SHOWN:
        cells = "".join(f"{results[p].get(key) or 0:>14.3f}" for p in results)
        print(f"{key:24}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
