"""The GPU benchmark suite and correctness check in one command (`make bench-gpu`).

Runs, each stage in its own process (a failing stage is reported, the rest still run):

1. per attention backend (triton; where flashinfer is installed, flashinfer and auto, its
   prefill with Triton's decode): bench/one_batch.py on the Llama-3.1-8B shape with random bf16 weights,
   prefill and decode at batch sizes 1 8 32 64 128 256 (512-token prompts, 128 output
   tokens), CUDA graphs on and off; then one 2048-token prefill. one_batch measures the
   device's copy bandwidth and bf16 matmul rate in the same process and gives each
   figure as a ratio to its roofline;
2. bench/offline.py: offline throughput, ShareGPT-like (1000 requests) and
   generated-shared-prefix (64 x 16, 2048 + 128 tokens, 256 out), radix cache on and off,
   each run as a share of its floor (bench/common/roofline.py) and the floors' on/off ratio;
3. tests/gpu/test_backend_parity_cuda.py: greedy tokens equal Hugging Face's on the same
   random weights for every backend, with and without CUDA graphs (and overlap);
4. bench/sampling.py: the sampler's time per call by setting and batch size, the
   one-kernel draw beside the sort-based torch path, and tests/gpu/test_sampling_cuda.py
   (the kernel's draws against the torch path's);
5. bench/overhead.py: the service stack (NATS, Redis, the six services) against the
   in-process engine on the 8B shape: throughput unstreamed and streamed at 256 requests
   at once (64 with --quick), TTFT at concurrency 1. Skipped, with the reason, where the
   stack's packages or the nats-server / redis-server binaries are missing (on a lent
   GPU, `bash tools/device_carry.sh --stack` carries them);
6. bench/start_up.py: start-up in a fresh process with empty kernel caches (the 8B shape
   cut to 4 layers): time to ready, then the first and the second request's latency (a
   first request seconds long means a kernel was still built inside it), then each kind
   of request in its FIRST_KINDS (other prompt lengths, sampled, penalised, logprobs, a
   JSON schema) a first time and a second;
7. bench/ttft.py: the in-process engine's time to first token on the 8B shape, one
   request at a time on an idle engine (16 to 2048 prompt tokens), beside the prefill
   step's own device time.

Writes every stage's JSON, `suite.json` (all of it, with date, device and commit) and
`suite.md` (the tables, each target met or not) to `--out`, and prints the tables.
`--quick`: batch sizes 1 8 64, 32 output tokens, graphs on only, a tenth of the offline
workloads (a few minutes on an H100).

    python bench/gpu_suite.py --tokenizer DIR --out bench-results [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
from common import default_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PARITY_TEST = "tests/gpu/test_backend_parity_cuda.py"
SAMPLING_TEST = "tests/gpu/test_sampling_cuda.py"


@dataclass(frozen=True)
class Target:
    name: str
    threshold: float
    at_most: bool  # the figure must be <= threshold (else >=)

    def met(self, figure: float) -> bool:
        return figure <= self.threshold if self.at_most else figure >= self.threshold


DECODE_BS1 = Target("decode bs1: step / roofline (weights + KV bytes)", 1.10, at_most=True)
DECODE_BS64 = Target("decode bs64: roofline / step (512 in)", 0.85, at_most=False)
PREFILL_2048 = Target("prefill 2048 tokens: fraction of the matmul rate", 0.80, at_most=False)
SHARED_PREFIX = Target("shared-prefix throughput: radix on / off", 5.0, at_most=False)


def bench_backends() -> list[str]:
    """The fast backends EngineConfig admits whose module is installed, and "auto" where
    it is neither of them (FlashInfer's prefill with Triton's decode)."""
    from radixserve.engine.config import ATTENTION_BACKENDS

    names = [
        name
        for name in ("triton", "flashinfer")
        if name in ATTENTION_BACKENDS and importlib.util.find_spec(name) is not None
    ]
    return [*names, "auto"] if len(names) == 2 else names


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


class Stages:
    """Runs each stage as a child process and keeps what it wrote, or why it did not."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.errors: list[str] = []

    def run(self, name: str, argv: list[str], result: Path) -> Any:
        print(f"\n== {name}: {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        rc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=self.env).returncode
        print(f"== {name}: exit {rc} after {time.perf_counter() - started:.0f} s", flush=True)
        if rc != 0:
            self.errors.append(f"{name}: exit status {rc}")
        if not result.exists():
            if rc == 0:
                self.errors.append(f"{name}: wrote no {result.name}")
            return None
        if result.suffix == ".xml":
            return junit_counts(result)
        return json.loads(result.read_text())


def junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = str((args.tokenizer or default_tokenizer_dir()).resolve())
    # The parity test's tiny models take their tokenizer from there too.
    stages = Stages({**os.environ, "RADIXSERVE_TEST_TOKENIZER_DIR": tokenizer})
    batch_sizes = ["1", "8", "64"] if args.quick else ["1", "8", "32", "64", "128", "256"]
    output_len = "32" if args.quick else "128"
    graphs = "on" if args.quick else "both"
    one_batch, prefill = [], []
    for backend in args.backends:
        path = out / f"one_batch_{backend}.json"
        argv = [str(BENCH / "one_batch.py"), "--tokenizer", tokenizer, "--backends", backend]
        argv += ["--batch-sizes", *batch_sizes, "--input-len", "512"]
        argv += ["--output-len", output_len, "--cuda-graph", graphs, "--json", str(path)]
        # A 256 x 512-token prefill's activations need ~20 GB: the KV pool gets less.
        argv += ["--mem-fraction-static", "0.65", "--engine-args", args.engine_args]
        one_batch.append(stages.run(f"one_batch {backend}", argv, path))
        path = out / f"prefill_2048_{backend}.json"
        argv = [str(BENCH / "one_batch.py"), "--tokenizer", tokenizer, "--backends", backend]
        argv += ["--batch-sizes", "1", "--input-len", "2048", "--output-len", "2"]
        argv += ["--cuda-graph", "off", "--json", str(path), "--engine-args", args.engine_args]
        prefill.append(stages.run(f"prefill 2048 {backend}", argv, path))
    path = out / "offline.json"
    argv = [str(BENCH / "offline.py"), "--tokenizer", tokenizer, "--radix", "both"]
    argv += ["--scale", "0.1" if args.quick else "1.0", "--json", str(path)]
    argv += ["--engine-args", args.engine_args]
    offline = stages.run("offline", argv, path)
    parity = sampling_check = None
    if not args.skip_parity:
        path = out / "parity.xml"
        argv = ["-m", "pytest", "-q", PARITY_TEST, "-p", "no:cacheprovider"]
        parity = stages.run("parity", [*argv, f"--junitxml={path}"], path)
        path = out / "sampling_check.xml"
        argv = ["-m", "pytest", "-q", SAMPLING_TEST, "-p", "no:cacheprovider"]
        sampling_check = stages.run("sampling check", [*argv, f"--junitxml={path}"], path)
    path = out / "sampling.json"
    argv = [str(BENCH / "sampling.py"), "--json", str(path), "--batch-sizes"]
    # --quick skips FlashInfer's sampling for reference: its JIT build takes minutes.
    argv += ["1", "64", "512", "--no-flashinfer"] if args.quick else ["1", "64", "256", "512"]
    sampling = stages.run("sampling", argv, path)
    stack = None
    stack_skipped = stack_missing()
    if stack_skipped is None:
        path = out / "stack.json"
        requests, output_len = ("64", "64") if args.quick else ("256", "256")
        argv = [str(BENCH / "overhead.py"), "--device", "cuda", "--shape", "llama-8b"]
        argv += ["--tokenizer", tokenizer, "--requests", requests, "--prompt-len", "512"]
        argv += ["--output-len", output_len, "--ttft-requests", "16", "--stream"]
        stack = stages.run("stack", [*argv, "--json", str(path)], path)
    path = out / "start_up.json"
    argv = [str(BENCH / "start_up.py"), "--tokenizer", tokenizer, "--layers", "4"]
    argv += ["--first-of-each", "--json", str(path), "--engine-args", args.engine_args]
    start_up = stages.run("start-up", argv, path)
    path = out / "ttft.json"
    argv = [str(BENCH / "ttft.py"), "--tokenizer", tokenizer, "--overlap", "on"]
    argv += ["--input-lens", "16", "128", "512", "2048", "--reps", "4" if args.quick else "10"]
    argv += ["--json", str(path), "--engine-args", args.engine_args]
    ttft = stages.run("ttft", argv, path)
    probe = next((r for r in one_batch if r is not None), None)
    return {
        "date": date.today().isoformat(),
        "device": probe["device"] if probe else None,
        "torch": torch.__version__,
        "commit": args.commit or git_commit(),
        "engine_args": json.loads(args.engine_args),
        "quick": args.quick,
        "decode_output_len": int(output_len),
        "bandwidth_bytes_s": probe["bandwidth_bytes_s"] if probe else None,
        "matmul_flop_s": probe["matmul_flop_s"] if probe else None,
        "one_batch": [row for r in one_batch if r for row in r["rows"]],
        "prefill_2048": [row for r in prefill if r for row in r["rows"]],
        "offline": offline,
        "parity": parity,
        "sampling": sampling,
        "sampling_check": sampling_check,
        "stack": stack,
        "stack_skipped": stack_skipped,
        "start_up": start_up,
        "ttft": ttft,
        "errors": stages.errors,
    }


def stack_missing() -> str | None:
    """Why the stack stage cannot run here (None: it can): a package the services or the
    bench's client need, or a NATS / Redis server binary."""
    for module in ("nats", "redis", "fastapi", "uvicorn", "httpx", "openai"):
        if importlib.util.find_spec(module) is None:
            return f"no {module} package"
    from radixserve.infra.binaries import find_nats_server, find_redis_server
    from radixserve.infra.process import InfraError
    from radixserve.infra.settings import InfraSettings

    settings = InfraSettings.from_env()
    try:
        find_nats_server(settings.nats_server_path)
        find_redis_server(settings.redis_server_path)
    except InfraError as exc:
        return str(exc)
    return None


def targets(result: dict[str, Any]) -> list[tuple[Target, str, float | None]]:
    """(target, where it was measured, figure) per backend; None when not measured."""
    rows: list[tuple[Target, str, float | None]] = []
    for backend in sorted({r["backend"] for r in result["one_batch"] + result["prefill_2048"]}):
        for target, bs in ((DECODE_BS1, 1), (DECODE_BS64, 64)):
            runs = [
                r for r in result["one_batch"] if r["backend"] == backend and r["batch_size"] == bs
            ]
            best = min(runs, key=lambda r: r["decode_x_roofline"], default=None)
            if best is None:
                rows.append((target, backend, None))
                continue
            x = best["decode_x_roofline"]
            figure = x if target.at_most else 1 / x
            rows.append((target, f"{backend}, graphs {best['graphs']}", figure))
        ratios = [
            r["prefill_vs_matmul_rate"] for r in result["prefill_2048"] if r["backend"] == backend
        ]
        rows.append((PREFILL_2048, backend, max(ratios, default=None)))
    offline = result["offline"] or {}
    ratio = offline.get("radix_on_over_off", {}).get("shared-prefix")
    rows.append((SHARED_PREFIX, "default backend", ratio))
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    quick = " (quick run)" if result["quick"] else ""
    lines = [
        f"# GPU suite{quick}: {result['date']}, {result['device']}, "
        f"torch {result['torch']}, commit {result['commit']}"
        + (
            f", engine options {json.dumps(result['engine_args'])}"
            if result.get("engine_args")
            else ""
        ),
        "",
        f"Roofline probe (same run): copy bandwidth {_fmt(_scaled(result['bandwidth_bytes_s']))}"
        f" TB/s, bf16 matmul {_fmt(_scaled(result['matmul_flop_s']), 0)} TFLOP/s.",
        "",
        "| target | measured on | figure | threshold | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for target, where, figure in targets(result):
        op = "<=" if target.at_most else ">="
        met = "n/a" if figure is None else ("yes" if target.met(figure) else "no")
        lines.append(
            f"| {target.name} | {where} | {_fmt(figure)} | {op} {target.threshold} | {met} |"
        )
    checks = (
        ("greedy tokens == HF, every backend x graphs (x overlap)", PARITY_TEST, "parity"),
        ("sampling kernel's draws == the torch sampler's", SAMPLING_TEST, "sampling_check"),
    )
    for what, test, key in checks:
        junit = result.get(key)
        if junit is None:
            continue
        failed = junit["failures"] + junit["errors"]
        ok = "yes" if failed == 0 and junit["passed"] else "no"
        lines.append(
            f"| {what} | {test} | {junit['passed']} passed, {failed} failed, "
            f"{junit['skipped']} skipped | all pass | {ok} |"
        )
    lines += [
        "",
        f"Prefill and decode, 512-token prompts, {result['decode_output_len']} output tokens:",
        "",
        "| backend | graphs | batch | prefill ms | prefill / matmul rate | decode step ms "
        "| roofline ms | x roofline | decode tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["one_batch"]:
        lines.append(
            f"| {r['backend']} | {r['graphs']} | {r['batch_size']} | {r['prefill_ms']:.1f} | "
            f"{r['prefill_vs_matmul_rate']:.2f} | {r['decode_step_ms']:.2f} | "
            f"{r['decode_roofline_ms']:.2f} | {r['decode_x_roofline']:.2f} | "
            f"{r['decode_tok_s']:.0f} |"
        )
    lines += ["", "| backend | prefill 2048 tokens ms | / matmul rate |", "| --- | --- | --- |"]
    for r in result["prefill_2048"]:
        lines.append(
            f"| {r['backend']} | {r['prefill_ms']:.1f} | {r['prefill_vs_matmul_rate']:.2f} |"
        )
    offline = result["offline"]
    if offline is not None:
        lines += [
            "",
            "| workload | radix | requests | req/s | input tok/s | output tok/s | total tok/s "
            "| cache hit rate | floor s | floor / time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in offline["rows"]:
            lines.append(
                f"| {r['workload']} | {r['radix']} | {r['completed']} | "
                f"{r['request_throughput']:.2f} | {r['input_throughput']:.0f} | "
                f"{r['output_throughput']:.0f} | {r['total_throughput']:.0f} | "
                f"{r['cache_hit_rate']:.3f} | {_fmt(r.get('floor_s'))} | "
                f"{_fmt(r.get('of_floor'))} |"
            )
        for name, ratio in offline.get("floor_on_over_off", {}).items():
            lines.append(
                f"\n{name}: the floors' ratio (radix off over on) is {ratio:.2f}x, the on/off "
                "throughput ratio at equal shares of the floor (bench/common/roofline.py)."
            )
    lines += _sampling_table(result.get("sampling"))
    lines += _stack_table(result.get("stack"), result.get("stack_skipped"))
    lines += _start_up_table(result.get("start_up"))
    lines += _ttft_table(result.get("ttft"))
    if result["errors"]:
        lines += ["", "Failed stages:", *(f"- {e}" for e in result["errors"])]
    return "\n".join(lines) + "\n"


def _sampling_table(sampling: dict[str, Any] | None) -> list[str]:
    """bench/sampling.py's rows: per batch size and setting, kernel beside torch."""
    if sampling is None:
        return []
    by_key: dict[tuple[int, str], dict[str, float]] = {}
    for row in sampling["rows"]:
        by_key.setdefault((row["bs"], row["setting"]), {})[row["path"]] = row["ms"]
    lines = [
        "",
        "Sampling, one `sample` call on [bs, 128256] bf16 logits (ms):",
        "",
        "| batch | setting | kernel | torch (sort) | torch / kernel |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (bs, setting), paths in by_key.items():
        kernel, torch_ms = paths.get("triton"), paths.get("torch")
        ratio = None if kernel is None or torch_ms is None else torch_ms / kernel
        lines.append(
            f"| {bs} | {setting} | {_fmt(kernel, 3)} | {_fmt(torch_ms, 3)} | {_fmt(ratio, 1)} |"
        )
    return lines


def _stack_table(stack: dict[str, Any] | None, skipped: str | None) -> list[str]:
    """bench/overhead.py's figures: the stack against the in-process engine."""
    if stack is None:
        return [] if skipped is None else ["", f"The stack stage was skipped: {skipped}."]
    return [
        "",
        f"The service stack against the in-process engine ({stack['model']}, "
        f"{stack['requests']} requests x {stack['prompt_len']} + {stack['output_len']} tokens):",
        "",
        "| figure | stack | engine | stack / engine |",
        "| --- | --- | --- | --- |",
        f"| tok/s, unstreamed | {stack['stack_tok_s']:.0f} | {stack['engine_tok_s']:.0f} "
        f"| {stack['throughput_ratio']:.2f} |",
        f"| tok/s, streamed | {_fmt(stack.get('stack_stream_tok_s'), 0)} | "
        f"{stack['engine_tok_s']:.0f} | {_fmt(stack.get('stream_throughput_ratio'))} |",
        f"| TTFT p50 at concurrency 1, ms | {stack['ttft_p50_stack_ms']:.1f} | "
        f"{stack['ttft_p50_engine_ms']:.1f} | +{stack['ttft_p50_added_ms']:.1f} ms |",
    ]


def _start_up_table(rows: list[dict[str, Any]] | None) -> list[str]:
    """bench/start_up.py's runs: ready time and the first two requests after it."""
    if not rows:
        return []
    lines = [
        "",
        "Start-up with empty kernel caches (8B shape, 4 layers; 512 + 8 tokens a request):",
        "",
        "| start-up prefill pass | ready s | first request ms | second request ms | first / second |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {'on' if r['prefill_warm_up'] else 'off'} | {r['ready_s']:.1f} | "
            f"{r['first_ms']:.1f} | {r['second_ms']:.1f} | {r['first_ms'] / r['second_ms']:.1f} |"
        )
    for r in rows:
        if not r.get("kinds"):
            continue
        lines += [
            "",
            "Then the grammar warm-up a server's worker makes (xgrammar's tokenizer "
            f"information, {r.get('grammar_warm_up_ms') or 0:.0f} ms) and each kind of "
            "request a first time and a second (ms; 8 tokens out):",
            "",
            "| request | first | second | first / second |",
            "| --- | --- | --- | --- |",
        ]
        for name, (first, second) in r["kinds"].items():
            lines.append(f"| {name} | {first:.1f} | {second:.1f} | {first / second:.1f} |")
    for r in rows:
        built = r.get("kernels_built") or {}
        if built:
            lines += ["", "Triton kernels built inside requests:", ""]
            lines += [f"- {label}: {', '.join(names)}" for label, names in built.items()]
    return lines


def _ttft_table(rows: list[dict[str, Any]] | None) -> list[str]:
    """bench/ttft.py's rows: the engine's time to first token by prompt length."""
    if not rows:
        return []
    lines = [
        "",
        "Time to first token, in-process engine, one request at a time (8B shape):",
        "",
        "| prompt tokens | TTFT ms | prefill step, device ms | steps |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['input_len']} | {r['ttft_ms']:.2f} | {r['first_step_device_ms']:.2f} | "
            f"{r['steps']} |"
        )
    return lines


def _scaled(value: float | None) -> float | None:
    return None if value is None else value / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--tokenizer", type=Path, default=None, help="a folder of tokenizer files")
    ap.add_argument("--quick", action="store_true", help="reduced scale, a few minutes")
    ap.add_argument("--backends", nargs="+", default=None, help="default: every fast one")
    ap.add_argument(
        "--skip-parity", action="store_true", help="skip the parity and sampling checks"
    )
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    ap.add_argument(
        "--engine-args",
        default="{}",
        help="more Engine options for every stage, a JSON object (e.g. '{\"enable_sm90_prefill\": true}')",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_suite.py needs a CUDA GPU; this machine has none.", file=sys.stderr)
        return 2
    args.backends = args.backends or bench_backends()
    result = run_suite(args)
    (args.out / "suite.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "suite.md").write_text(table)
    print("\n" + table)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
