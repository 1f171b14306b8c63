"""Start-up on a fresh machine: how long the engine takes to be ready, and whether the
first request then waits on kernel builds.

Each run is a new process with empty kernel caches (its own Triton cache and FlashInfer
workspace in a temporary folder), as on a freshly started GPU machine or container. It
builds the engine on the device (Llama-3.1-8B's shapes, random bf16 weights, no
download; `--layers` for fewer), then times two requests one after the other, each a
prompt of `--input-len` random tokens (no shared prefix) and `--output-len` greedy
tokens:

- ready: the `Engine(...)` call, up to the point a worker reports ready;
- first: the first request, end to end;
- second: the same again, once every kernel it needs has been built.

first / second near 1 means the start-up built what requests need; a first request
seconds long means a kernel was still built inside it. `--first-of-each` then makes the
grammar warm-up a server's worker makes before its engine runs (timed) and sends each
kind of request in FIRST_KINDS twice (prompts of other lengths, sampled, penalised,
with logprobs, constrained by a JSON schema): a kind whose first takes far longer than
its second built something inside that request. `--skip-prefill-warm-up` runs
the engine without its start-up prefill pass (`ModelRunner._warm_up_prefill`), to
measure what that pass buys; `--compare` runs both, one process each.

    python bench/start_up.py --tokenizer DIR [--compare] [--layers 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import SHAPES, dummy_engine, write_model_folder  # noqa: E402
from common.step_probes import KernelBuilds  # noqa: E402


# (name, prompt tokens, sampling parameters besides max_new_tokens): the requests
# `--first-of-each` times, each a first time and a second. The prompt lengths give the
# projections other row counts than the start-up's passes ran. The two JSON requests
# have schemas of their own, so each compiles its grammar and their difference is what
# only a first constrained request pays.
def _schema(key: str) -> str:
    return json.dumps(
        {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    )


_GREEDY = {"temperature": 0, "ignore_eos": True}
FIRST_KINDS: list[tuple[str, int, tuple[dict[str, Any], ...]]] = [
    ("prompt of 5", 5, (_GREEDY, _GREEDY)),
    ("prompt of 24", 24, (_GREEDY, _GREEDY)),
    ("prompt of 40", 40, (_GREEDY, _GREEDY)),
    ("prompt of 100", 100, (_GREEDY, _GREEDY)),
    ("top-p 0.9", 64, ({"temperature": 0.7, "top_p": 0.9, "ignore_eos": True},) * 2),
    (
        "penalties",
        64,
        ({"temperature": 0, "repetition_penalty": 1.1, "frequency_penalty": 0.5},) * 2,
    ),
    ("logprobs", 64, ({"temperature": 0, "return_logprob": True, "top_logprobs_num": 5},) * 2),
    (
        "json schema",
        64,
        (
            {"temperature": 0, "json_schema": _schema("a")},
            {"temperature": 0, "json_schema": _schema("b")},
        ),
    ),
]


def fresh_cache_env(root: Path) -> dict[str, str]:
    """The environment of a process whose kernel caches start empty."""
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    env["FLASHINFER_WORKSPACE_BASE"] = str(root / "flashinfer")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return env


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One engine in this process: ready time, then two requests' latencies."""
    import torch

    from radixserve.engine.runner import ModelRunner

    if args.skip_prefill_warm_up:
        ModelRunner._warm_up_prefill = lambda self, tokens=16: None  # type: ignore[method-assign]
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    folder = write_model_folder(args.tokenizer, shape)
    started = time.perf_counter()
    engine = dummy_engine(folder, args.device, args.backend, **json.loads(args.engine_args))
    ready_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.model_config.vocab_size
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    latencies = []
    kinds: dict[str, list[float]] = {}
    grammar_warm_up_ms = None
    # The Triton kernels each request built (its `step` is the request's index in
    # `labels`): the names of what a slow first request waited for.
    labels = ["first", "second"]
    with KernelBuilds() as builds:
        for i in range(2):
            prompt = torch.randint(10, vocab, (args.input_len,), generator=gen).tolist()
            builds.step = i
            t0 = time.perf_counter()
            out = engine.generate(input_ids=[prompt], sampling_params=params)
            latencies.append(time.perf_counter() - t0)
            if len(out[0]["output_ids"]) != args.output_len:
                raise SystemExit(f"expected {args.output_len} tokens, got {out[0]['output_ids']}")
        if args.first_of_each:
            # As a server's worker does before its engine runs (xgrammar's tokenizer
            # information): what the JSON requests' first then pays is the engine's own.
            builds.step = -1
            t0 = time.perf_counter()
            engine.grammars.warm_up()
            grammar_warm_up_ms = (time.perf_counter() - t0) * 1e3
            labels += [
                f"{name} #{k + 1}" for name, _, both in FIRST_KINDS for k in range(len(both))
            ]
            kinds = first_of_each(engine, gen, vocab, args.output_len, builds)
    engine.shutdown()
    built: dict[str, list[str]] = {}
    for step, name, _ in builds.builds:
        if step >= 0:
            built.setdefault(labels[step], []).append(name)
    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "backend": args.backend,
        "prefill_warm_up": not args.skip_prefill_warm_up,
        "layers": shape["num_hidden_layers"],
        "ready_s": ready_s,
        "first_ms": latencies[0] * 1e3,
        "second_ms": latencies[1] * 1e3,
        "grammar_warm_up_ms": grammar_warm_up_ms,
        "kinds": kinds,
        "kernels_built": built,
    }


def first_of_each(
    engine: Any, gen: Any, vocab: int, output_len: int, builds: KernelBuilds
) -> dict[str, list[float]]:
    """Each of FIRST_KINDS sent twice, one after the other: {name: [first ms, second ms]}
    (`builds.step` the request's index, from 2: the two requests before are 0 and 1)."""
    import torch

    kinds: dict[str, list[float]] = {}
    requests = itertools.count(2)
    for name, input_len, both in FIRST_KINDS:
        for extra in both:
            builds.step = next(requests)
            params = {"max_new_tokens": output_len, **extra}
            prompt = torch.randint(10, vocab, (input_len,), generator=gen).tolist()
            t0 = time.perf_counter()
            out = engine.generate(input_ids=[prompt], sampling_params=params)
            kinds.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            if not out[0]["output_ids"]:
                raise SystemExit(f"{name}: no tokens came back")
    return kinds


def run_fresh(args: argparse.Namespace, skip: bool) -> dict[str, Any]:
    """`measure` in a new process with empty kernel caches."""
    with tempfile.TemporaryDirectory(prefix="start-up-") as root:
        out = Path(root) / "result.json"
        argv = [
            sys.executable,
            __file__,
            "--tokenizer",
            str(args.tokenizer),
            "--backend",
            args.backend,
            "--device",
            args.device,
            "--shape",
            args.shape,
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--engine-args",
            args.engine_args,
            "--child-json",
            str(out),
        ]
        if args.first_of_each:
            argv.append("--first-of-each")
        if args.layers:
            argv += ["--layers", str(args.layers)]
        if skip:
            argv.append("--skip-prefill-warm-up")
        subprocess.run(argv, env=fresh_cache_env(Path(root)), check=True, timeout=args.timeout_s)
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--backend", default="auto", help="--attention-backend")
    ap.add_argument("--device", default="cuda", help="cpu: the tiny shape, to check the script")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick look")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--skip-prefill-warm-up", action="store_true")
    ap.add_argument("--compare", action="store_true", help="with and without the warm-up pass")
    ap.add_argument("--first-of-each", action="store_true", help="then each of FIRST_KINDS, twice")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_json is not None:
        args.child_json.write_text(json.dumps(measure(args)))
        return 0
    skips = [False, True] if args.compare else [args.skip_prefill_warm_up]
    rows = [run_fresh(args, skip) for skip in skips]
    print(f"\n{'prefill warm-up':<16} {'ready s':>8} {'first ms':>9} {'second ms':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{'on' if r['prefill_warm_up'] else 'off':<16} {r['ready_s']:>8.1f} "
            f"{r['first_ms']:>9.1f} {r['second_ms']:>9.1f} {r['first_ms'] / r['second_ms']:>6.2f}"
        )
    for r in rows:
        if r["kinds"]:
            print(
                f"\ngrammar warm-up (xgrammar's tokenizer information): {r['grammar_warm_up_ms']:.1f} ms"
            )
            print(
                f"\nwarm-up {'on' if r['prefill_warm_up'] else 'off'}: {'request':<16} "
                f"{'first ms':>9} {'second ms':>9} {'ratio':>6}"
            )
        for name, (first, second) in r["kinds"].items():
            print(f"{'':<15} {name:<16} {first:>9.1f} {second:>9.1f} {first / second:>6.2f}")
    for r in rows:
        for label, names in r["kernels_built"].items():
            print(f"Triton kernels built in the {label} request: {', '.join(names)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
