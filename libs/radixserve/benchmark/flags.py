"""The flags of `radixserve bench serving` (argparse only: `radixserve --help` stays quick)."""

from __future__ import annotations

import argparse

from radixserve.benchmark.datasets import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW

BACKENDS = ("openai", "radixserve")
DATASETS = ("random", "sharegpt", "generated-shared-prefix")


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
        help="local HF tokenizer folder: send prompts as text (default: token ids)",
    )
    add("--dataset-name", choices=DATASETS, default="random")
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
    add("--sharegpt-context-len", type=int, default=2048, help="prompt + output at most")
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
    add("--output-file", default=None, help="append the summary as one JSON line")
