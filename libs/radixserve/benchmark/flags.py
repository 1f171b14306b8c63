"""The flags of `radixserve bench serving` (argparse only: `radixserve --help` stays quick)."""

from __future__ import annotations

import argparse

from radixserve.benchmark.datasets import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW

BACKENDS = ("openai", "radixserve")
DATASETS = ("random", "sharegpt", "generated-shared-prefix", "custom")
SLO_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput names


def slo(pair: str) -> tuple[str, float]:
    """One `--goodput` objective, vLLM's spelling: `ttft:50` (milliseconds)."""
    name, _, value = pair.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if name not in SLO_METRICS or ms < 0:
        raise argparse.ArgumentTypeError(
            f"expected NAME:MS with NAME one of {', '.join(SLO_METRICS)} and MS >= 0, got {pair!r}"
        )
    return name, ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: POST /v1/completions (any OpenAI-compatible server); radixserve: "
        "SGLang's native POST /generate",
    )
    add("--base-url", default="http://127.0.0.1:8000", help="the server under test")
    add("--model", default=None, help="model name to send (default: the server's first)")
    add(
        "--tokenizer",
        default=None,
        help="local HF tokenizer folder: send prompts as text (default: token ids); "
        "--dataset-path counts tokens with it",
    )
    add(
        "--dataset-name",
        choices=DATASETS,
        default=None,
        help="default: random, or with --dataset-path the file's kind (sharegpt: "
        "ShareGPT-format JSON; custom: a .jsonl of {prompt, output_len})",
    )
    add(
        "--dataset-path",
        default=None,
        help="ShareGPT-format JSON (first human turn, its gpt answer's length) or a JSONL "
        "of prompts; needs --tokenizer",
    )
    add(
        "--num-prompts",
        type=int,
        default=1000,
        help="requests (generated-shared-prefix: groups x prompts per group)",
    )
    add("--seed", type=int, default=1)
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * ratio, len]",
    )
    add("--sharegpt-output-len", type=int, default=None, help="fix every output length")
    add(
        "--sharegpt-context-len",
        type=int,
        default=None,
        help="prompt + output at most: a file's longer pairs are dropped, as SGLang does "
        "(synthetic sharegpt: clipped to it, default 2048)",
    )
    add("--gsp-num-groups", type=int, default=64)
    add("--gsp-prompts-per-group", type=int, default=16)
    add("--gsp-system-prompt-len", type=int, default=2048)
    add("--gsp-question-len", type=int, default=128)
    add("--gsp-output-len", type=int, default=256)
    add("--token-id-low", type=int, default=DEFAULT_VOCAB_LOW, help="prompt token ids from")
    add("--token-id-high", type=int, default=DEFAULT_VOCAB_HIGH, help="... up to (excluded)")
    add(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    add("--max-concurrency", type=int, default=None, help="requests in flight at most")
    add("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    add(
        "--flush-cache",
        action="store_true",
        help="POST /flush_cache before the run (radixserve, SGLang)",
    )
    add("--warmup-requests", type=int, default=1, help="sent first, not counted")
    add("--request-timeout-s", type=float, default=600.0)
    add(
        "--goodput",
        nargs="+",
        type=slo,
        default=None,
        metavar="NAME:MS",
        help="service-level objectives (vLLM's spelling: ttft:50 tpot:6 e2el:2000): "
        "request_goodput counts the requests meeting all of them, per second",
    )
    add("--output-file", default=None, help="append the summary as one JSON line")
