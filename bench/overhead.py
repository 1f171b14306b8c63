"""What the service stack costs over the in-process engine, in one run.

The same workload (N requests of P random prompt tokens and O output tokens, greedy,
EOS ignored) goes through the whole stack (NATS, Redis, the six services started as
`radixserve up` starts them) with `openai`'s async client, and through the in-process
`Engine` on the same model, one after the other in this process's run:

- TTFT at concurrency 1 (streaming: request sent -> first chunk), p50 and p99, and
  what the stack adds (stack minus engine, at the same percentile);
- throughput at concurrency N (output tokens / wall time), stack / engine.

    .venv/bin/python bench/overhead.py               # embedded SmolLM2 on the CPU
    .venv/bin/python bench/overhead.py --requests 8  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine
from radixserve.engine.model.loader import resolve_model_path
from radixserve.infra import Infra
from radixserve.stack import Stack, StackSpec


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)
    return ordered[k]


def make_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(count)]


async def stack_ttft(url: str, prompts: list[list[int]], output_len: int) -> list[float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in prompts:
        started = time.perf_counter()
        stream = await client.completions.create(
            model="bench",
            prompt=prompt,
            max_tokens=output_len,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter() - started
        assert first is not None
        out.append(first)
    await client.close()
    return out


async def stack_throughput(
    url: str, prompts: list[list[int]], output_len: int
) -> tuple[float, int]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    started = time.perf_counter()
    replies = await asyncio.gather(
        *(
            client.completions.create(
                model="bench",
                prompt=p,
                max_tokens=output_len,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for p in prompts
        )
    )
    elapsed = time.perf_counter() - started
    await client.close()
    tokens = sum(r.usage.completion_tokens for r in replies if r.usage is not None)
    return elapsed, tokens


async def engine_ttft(engine: Engine, prompts: list[list[int]], output_len: int) -> list[float]:
    out = []
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    for prompt in prompts:
        started = time.perf_counter()
        first = None
        async for _delta in engine.generate_stream(input_ids=prompt, sampling_params=params):
            if first is None:
                first = time.perf_counter() - started
        assert first is not None
        out.append(first)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    model_dir = resolve_model_path(args.model)
    results: dict[str, Any] = {"model": str(model_dir), "device": args.device}

    with Infra() as infra:
        spec = StackSpec(
            nats_url=infra.nats_url,
            redis_url=infra.redis_url,
            subject_prefix="bench",
            host="127.0.0.1",
            port=18123,
            workers=1,
            model_dir=model_dir,
            served_model_name="bench",
            worker_args=["--device", args.device],
            tokenizer_args=[],
            log_dir=Path(tempfile.mkdtemp(prefix="radixserve-bench-")),
        )
        stack = Stack(spec, say=lambda text: print(text, file=sys.stderr))
        stack.start()
        try:
            stack.wait_healthy(300)
            engine_vocab = Engine(model_path=str(model_dir), device=args.device)
            prompts = make_prompts(engine_vocab.runner.vocab_size, args.requests, args.prompt_len)
            engine_vocab.shutdown()
            ttft_prompts = prompts[: args.ttft_requests]
            asyncio.run(stack_ttft(spec.url, ttft_prompts[:2], args.output_len))  # warm-up
            httpx_flush(spec.url)
            stack_first = asyncio.run(stack_ttft(spec.url, ttft_prompts, args.output_len))
            httpx_flush(spec.url)
            stack_wall, stack_tokens = asyncio.run(
                stack_throughput(spec.url, prompts, args.output_len)
            )
        finally:
            stack.stop()

    with Engine(model_path=str(model_dir), device=args.device) as engine:
        asyncio.run(engine_ttft(engine, ttft_prompts[:2], args.output_len))  # warm-up
        engine.flush_cache()
        engine_first = asyncio.run(engine_ttft(engine, ttft_prompts, args.output_len))
        engine.flush_cache()
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        started = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine_wall = time.perf_counter() - started
        assert isinstance(outs, list)
        engine_tokens = sum(len(o["output_ids"]) for o in outs)

    for name, stack_q, engine_q in (
        ("p50", percentile(stack_first, 50), percentile(engine_first, 50)),
        ("p99", percentile(stack_first, 99), percentile(engine_first, 99)),
    ):
        results[f"ttft_{name}_stack_ms"] = stack_q * 1e3
        results[f"ttft_{name}_engine_ms"] = engine_q * 1e3
        results[f"ttft_{name}_added_ms"] = (stack_q - engine_q) * 1e3
    results["ttft_median_of_pairs_added_ms"] = 1e3 * statistics.median(
        s - e for s, e in zip(stack_first, engine_first, strict=True)
    )
    results["stack_tok_s"] = stack_tokens / stack_wall
    results["engine_tok_s"] = engine_tokens / engine_wall
    results["throughput_ratio"] = results["stack_tok_s"] / results["engine_tok_s"]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(
        f"\nTTFT at concurrency 1 (n={len(stack_first)}): p50 stack {results['ttft_p50_stack_ms']:.1f} ms"
        f" vs engine {results['ttft_p50_engine_ms']:.1f} ms (added {results['ttft_p50_added_ms']:.1f} ms);"
        f" p99 added {results['ttft_p99_added_ms']:.1f} ms\n"
        f"Throughput at concurrency {args.requests}: stack {results['stack_tok_s']:.1f} tok/s,"
        f" engine {results['engine_tok_s']:.1f} tok/s, ratio {results['throughput_ratio']:.2f}x"
    )
    return 0


def httpx_flush(url: str) -> None:
    import httpx

    httpx.post(f"{url}/flush_cache", timeout=30)


if __name__ == "__main__":
    sys.exit(main())
