"""`radixserve bench serving`: load an OpenAI-compatible server and report its latencies.

    radixserve bench serving --base-url http://127.0.0.1:8000 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 4 --num-prompts 64 \\
        --max-concurrency 8 --output-file results.jsonl

    radixserve bench serving --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json \
        --tokenizer DIR --num-prompts 1000 --request-rate 16 --goodput ttft:50 tpot:6

Flag names are SGLang's bench_serving's where it has them (vLLM's for `--goodput`), so
the same command runs against radixserve, SGLang, vLLM or a llama.cpp server
(`--backend openai`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from radixserve.benchmark.client import RequestSpec, send_request
from radixserve.benchmark.dataset_files import (
    file_kind,
    prompt_file_requests,
    sharegpt_file_requests,
)
from radixserve.benchmark.datasets import (
    BenchRequest,
    TokenRange,
    generated_shared_prefix,
    random_requests,
    sharegpt_like_requests,
)
from radixserve.benchmark.flags import add_arguments
from radixserve.benchmark.report import render_table, summarize
from radixserve.benchmark.runner import run_requests

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["add_arguments", "bench", "build_requests", "dataset_name", "run"]

SYNTHETIC_SHAREGPT_CONTEXT = 2048


def dataset_name(ns: argparse.Namespace) -> str:
    """`--dataset-name`, defaulting to random, or with `--dataset-path` to the file's kind."""
    if ns.dataset_path is None:
        if ns.dataset_name == "custom":
            raise ValueError("--dataset-name custom reads --dataset-path FILE.jsonl")
        return str(ns.dataset_name or "random")
    if ns.dataset_name not in (None, "sharegpt", "custom"):
        raise ValueError(
            f"--dataset-path is read as sharegpt or custom, not --dataset-name {ns.dataset_name}"
        )
    return str(ns.dataset_name or file_kind(ns.dataset_path))


def load_tokenizer(ns: argparse.Namespace) -> PreTrainedTokenizerBase | None:
    if ns.tokenizer is None:
        if ns.dataset_path is not None:
            raise ValueError(
                "--dataset-path needs --tokenizer DIR (a local Hugging Face tokenizer folder) "
                "to count the prompts' and answers' tokens"
            )
        return None
    from radixserve.model_files.tokenizer import load_tokenizer as load_local

    return load_local(ns.tokenizer)


def build_requests(
    ns: argparse.Namespace,
    rng: random.Random,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[BenchRequest]:
    tokens = TokenRange(ns.token_id_low, ns.token_id_high)
    name = dataset_name(ns)
    if ns.dataset_path is not None:
        if tokenizer is None:
            tokenizer = load_tokenizer(ns)
        assert tokenizer is not None  # load_tokenizer raises without --tokenizer
        lengths = (ns.sharegpt_output_len, ns.sharegpt_context_len)
        if name == "sharegpt":
            return sharegpt_file_requests(ns.dataset_path, tokenizer, rng, ns.num_prompts, *lengths)
        return prompt_file_requests(ns.dataset_path, tokenizer, ns.num_prompts, *lengths)
    if name == "random":
        return random_requests(
            rng,
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            ns.random_range_ratio,
            tokens,
        )
    if name == "sharegpt":
        context_len = ns.sharegpt_context_len or SYNTHETIC_SHAREGPT_CONTEXT
        return sharegpt_like_requests(
            rng, ns.num_prompts, context_len, ns.sharegpt_output_len, tokens
        )
    return generated_shared_prefix(
        rng,
        ns.gsp_num_groups,
        ns.gsp_prompts_per_group,
        ns.gsp_system_prompt_len,
        ns.gsp_question_len,
        ns.gsp_output_len,
        tokens,
    )


def _specs(
    ns: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    tokenizer: PreTrainedTokenizerBase | None,
) -> list[RequestSpec]:
    """Token-id prompts go as text where a tokenizer is given (servers that take text only)."""
    prompts: list[list[int] | str] = [
        str(tokenizer.decode(r.prompt)) if tokenizer and isinstance(r.prompt, list) else r.prompt
        for r in requests
    ]
    return [
        RequestSpec(
            model=model,
            prompt=prompt,
            prompt_len=r.prompt_len,
            output_len=r.output_len,
            ignore_eos=not ns.disable_ignore_eos,
        )
        for r, prompt in zip(requests, prompts, strict=True)
    ]


async def _first_model(http: httpx.AsyncClient) -> str:
    response = await http.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("the server lists no model; pass --model")
    return str(models[0]["id"])


async def bench(ns: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(ns.seed)
    tokenizer = load_tokenizer(ns)
    requests = build_requests(ns, rng, tokenizer)
    limits = httpx.Limits(max_connections=ns.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(
        base_url=ns.base_url, timeout=ns.request_timeout_s, limits=limits
    ) as http:
        model = ns.model or await _first_model(http)
        specs = _specs(ns, model, requests, tokenizer)
        if ns.flush_cache:
            (await http.post("/flush_cache")).raise_for_status()

        async def send(spec: RequestSpec) -> Any:
            return await send_request(http, spec, ns.backend)

        for spec in specs[: ns.warmup_requests]:
            warm = await send(spec)
            if not warm.success:
                raise ValueError(f"the warmup request failed: {warm.error}")
        results, duration_s = await run_requests(
            specs,
            send,
            ns.request_rate,
            ns.max_concurrency,
            rng,
            progress=not ns.disable_tqdm,
        )
    settings = {
        "backend": ns.backend,
        "base_url": ns.base_url,
        "model": model,
        "dataset_name": dataset_name(ns),
        "dataset_path": ns.dataset_path,
        "sharegpt_output_len": ns.sharegpt_output_len,
        "num_prompts": len(specs),
        "seed": ns.seed,
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "max_concurrency": ns.max_concurrency,
    }
    return summarize(results, duration_s, settings, dict(ns.goodput) if ns.goodput else None)


def run(ns: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        summary = asyncio.run(bench(ns))
    except (httpx.HTTPError, ValueError, OSError) as exc:  # OSError: a file or folder missing
        print(f"radixserve bench serving: {exc}", file=sys.stderr)
        return 2
    print(render_table(summary))
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if ns.output_file:
        with Path(ns.output_file).open("a") as out:
            out.write(json.dumps(summary) + "\n")
    return 0 if summary["completed"] else 1
