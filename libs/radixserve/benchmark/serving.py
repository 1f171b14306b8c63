"""`radixserve bench serving`: load an OpenAI-compatible server and report its latencies.

    radixserve bench serving --base-url http://127.0.0.1:8000 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 4 --num-prompts 64 \\
        --max-concurrency 8 --output-file results.jsonl

Flag names are SGLang's bench_serving's where it has them, so the same command runs
against radixserve, SGLang, vLLM or a llama.cpp server (`--backend openai`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import httpx

from radixserve.benchmark.client import RequestSpec, send_request
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

__all__ = ["add_arguments", "bench", "build_requests", "run"]


def build_requests(ns: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    tokens = TokenRange(ns.token_id_low, ns.token_id_high)
    if ns.dataset_name == "random":
        return random_requests(
            rng,
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            ns.random_range_ratio,
            tokens,
        )
    if ns.dataset_name == "sharegpt":
        return sharegpt_like_requests(
            rng, ns.num_prompts, ns.sharegpt_context_len, ns.sharegpt_output_len, tokens
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


def _specs(ns: argparse.Namespace, model: str, requests: list[BenchRequest]) -> list[RequestSpec]:
    prompts: list[list[int] | str] = [r.prompt for r in requests]
    if ns.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer, local_files_only=True)
        prompts = [str(tokenizer.decode(r.prompt)) for r in requests]
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
    requests = build_requests(ns, rng)
    limits = httpx.Limits(max_connections=ns.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(
        base_url=ns.base_url, timeout=ns.request_timeout_s, limits=limits
    ) as http:
        model = ns.model or await _first_model(http)
        specs = _specs(ns, model, requests)
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
        "dataset_name": ns.dataset_name,
        "num_prompts": len(specs),
        "seed": ns.seed,
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "max_concurrency": ns.max_concurrency,
    }
    return summarize(results, duration_s, settings)


def run(ns: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        summary = asyncio.run(bench(ns))
    except (httpx.HTTPError, ValueError) as exc:
        print(f"radixserve bench serving: {exc}", file=sys.stderr)
        return 2
    print(render_table(summary))
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if ns.output_file:
        with Path(ns.output_file).open("a") as out:
            out.write(json.dumps(summary) + "\n")
    return 0 if summary["completed"] else 1
