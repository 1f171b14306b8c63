"""What the service stack costs over the in-process engine, in one run.

The same workload (N requests of P random prompt tokens and O output tokens, greedy,
EOS ignored) goes through the whole stack (NATS, Redis, the six services started as
`radixserve up` starts them) and through the in-process `Engine` on the same model, one
after the other in this process's run:

- TTFT at concurrency 1 (streaming, `openai`'s async client: request sent -> first
  chunk), p50 and p99, and what the stack adds (stack minus engine, at the same
  percentile);
- throughput at concurrency N (output tokens / wall time), stack / engine: all N sent at
  once from `--clients` processes over raw HTTP (one Python process driving hundreds of
  streams through `openai` is slower than the stack it measures); with `--stream` the
  stack's requests are also sent streamed (one SSE chunk a token, as chat clients read
  them), with each request's time per output token after the first;
- over each throughput phase, every service's CPU seconds per second and per output
  token (`cpu_us_per_token`) and the worker's steps (count, mean time and batch, share of
  the phase in steps), from /proc and the worker's /metrics; `--sample DIR` also samples
  the services' Python stacks there.

    .venv/bin/python bench/overhead.py               # embedded SmolLM2 on the CPU
    .venv/bin/python bench/overhead.py --requests 8  # a quick look
    # on a GPU machine: Llama-3.1-8B's shapes, random weights, SmolLM2's tokenizer
    python bench/overhead.py --device cuda --shape llama-8b --tokenizer DIR \
        --requests 256 --prompt-len 512 --output-len 256 --stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import PhaseMeter, dummy_model_folder

from radixserve import Engine
from radixserve.infra import Infra
from radixserve.model_files.paths import resolve_model_path
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


async def stack_ttft_raw(url: str, prompts: list[list[int]], output_len: int) -> list[float]:
    """TTFT as stack_ttft, over raw HTTP (httpx, one keep-alive connection): what the
    stack adds apart from the client library's own time."""
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for prompt in prompts:
            body = {"model": "bench", "prompt": prompt, "max_tokens": output_len}
            body |= {"temperature": 0, "ignore_eos": True, "stream": True}
            first = None
            started = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - started
            assert first is not None
            out.append(first)
    return out


async def _client_shard(
    url: str, prompts: list[list[int]], output_len: int, stream: bool
) -> list[tuple[int, float]]:
    """One client process's requests, all at once, over raw HTTP (a JSON body made
    beforehand, SSE lines parsed as they come): (tokens, s per token after the first)."""
    import httpx

    bodies = [
        json.dumps(
            {
                "model": "bench",
                "prompt": p,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            }
        ).encode()
        for p in prompts
    ]
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=None)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(body: bytes) -> tuple[int, float]:
            if not stream:
                reply = await client.post("/v1/completions", content=body, headers=headers)
                reply.raise_for_status()
                return int(reply.json()["usage"]["completion_tokens"]), 0.0
            first = last = 0.0
            tokens = 0
            async with client.stream(
                "POST", "/v1/completions", content=body, headers=headers
            ) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = first or now
                        last = now
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
            return tokens, (last - first) / max(tokens - 1, 1)

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _client_process(
    url: str, prompts: list[list[int]], output_len: int, stream: bool, barrier: Any, out: Any
) -> None:
    barrier.wait()
    started = time.monotonic()
    results = asyncio.run(_client_shard(url, prompts, output_len, stream))
    out.put((started, time.monotonic(), results))


def stack_load(
    url: str,
    prompts: list[list[int]],
    output_len: int,
    stream: bool,
    clients: int,
    meter: Callable[[], PhaseMeter],
) -> tuple[float, int, list[float], dict[str, Any]]:
    """Every prompt at once from `clients` processes (one Python client of hundreds of
    streams is slower than the stack): (wall s, tokens, each request's s per token after
    its first; 0 unstreamed; `meter`'s report, started once the clients are ready)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_process,
            args=(url, prompts[k::clients], output_len, stream, barrier, out),
            daemon=True,
        )
        for k in range(clients)
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    phase = meter()
    shards = [out.get(timeout=900) for _ in procs]
    results = [r for _, _, rs in shards for r in rs]
    tokens = sum(t for t, _ in results)
    report = phase.report(tokens)
    for proc in procs:
        proc.join(10)
    wall = max(end for _, end, _ in shards) - min(start for start, _, _ in shards)
    return wall, tokens, [tpot for _, tpot in results], report


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
    parser.add_argument(
        "--shape",
        choices=["llama-8b", "tiny"],
        default=None,
        help="random weights of this shape (load_format dummy) instead of --model; tiny: "
        "a model so small that the services, not the engine, bound the stack on a CPU",
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help="its tokenizer (--shape)")
    parser.add_argument(
        "--stream", action="store_true", help="also measure the stack's streamed throughput"
    )
    parser.add_argument("--clients", type=int, default=8, help="client processes sending the load")
    parser.add_argument(
        "--sample",
        type=Path,
        default=None,
        help="sample the services' Python stacks into this folder (bench/sampler)",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    engine_args: dict[str, Any] = {}
    worker_args = ["--device", args.device]
    if args.shape is not None:
        if args.tokenizer is None:
            parser.error("--shape needs --tokenizer")
        model_dir = dummy_model_folder(args.tokenizer, args.shape)
        engine_args["load_format"] = "dummy"
        worker_args += ["--load-format", "dummy"]
    else:
        model_dir = resolve_model_path(args.model)
    results: dict[str, Any] = {
        "model": args.shape or str(model_dir),
        "device": args.device,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
    }

    if args.sample is not None:  # the services inherit these; sitecustomize starts the sampler
        sampler = str(Path(__file__).resolve().parent / "sampler")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (sampler, os.environ.get("PYTHONPATH")) if p
        )
        os.environ["RADIXSERVE_SAMPLE_DIR"] = str(args.sample.resolve())

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
            worker_args=worker_args,
            tokenizer_args=[],
            log_dir=Path(tempfile.mkdtemp(prefix="radixserve-bench-")),
            metrics_port_base=18200,
        )
        stack = Stack(spec, say=lambda text: print(text, file=sys.stderr))
        stack.start()
        try:
            stack.wait_healthy(300)
            prompts = make_prompts(vocab_size(model_dir), args.requests, args.prompt_len)
            ttft_prompts = prompts[: args.ttft_requests]
            asyncio.run(stack_ttft(spec.url, ttft_prompts[:2], args.output_len))  # warm-up
            httpx_flush(spec.url)
            stack_first = asyncio.run(stack_ttft(spec.url, ttft_prompts, args.output_len))
            httpx_flush(spec.url)
            raw_first = asyncio.run(stack_ttft_raw(spec.url, ttft_prompts, args.output_len))
            results["ttft_p50_stack_raw_http_ms"] = 1e3 * percentile(raw_first, 50)
            httpx_flush(spec.url)
            metrics_url = f"http://127.0.0.1:{spec.metrics_ports()['worker-0']}/metrics"

            def meter() -> PhaseMeter:
                return PhaseMeter(stack, metrics_url)

            stack_wall, stack_tokens, _, results["phase"] = stack_load(
                spec.url, prompts, args.output_len, False, args.clients, meter
            )
            if args.stream:
                httpx_flush(spec.url)
                stream_wall, stream_tokens, tpots, results["phase_streamed"] = stack_load(
                    spec.url, prompts, args.output_len, True, args.clients, meter
                )
                results["stack_stream_tok_s"] = stream_tokens / stream_wall
                results["stack_stream_tpot_p50_ms"] = 1e3 * percentile(tpots, 50)
                results["stack_stream_tpot_p99_ms"] = 1e3 * percentile(tpots, 99)
        finally:
            stack.stop()

    with Engine(model_path=str(model_dir), device=args.device, **engine_args) as engine:
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
    if args.stream:
        results["stream_throughput_ratio"] = results["stack_stream_tok_s"] / results["engine_tok_s"]
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
    if args.stream:
        print(
            f"Streamed: stack {results['stack_stream_tok_s']:.1f} tok/s, ratio"
            f" {results['stream_throughput_ratio']:.2f}x; time per output token p50"
            f" {results['stack_stream_tpot_p50_ms']:.2f} ms, p99"
            f" {results['stack_stream_tpot_p99_ms']:.2f} ms"
        )
    return 0


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def httpx_flush(url: str) -> None:
    import httpx

    httpx.post(f"{url}/flush_cache", timeout=30)


if __name__ == "__main__":
    sys.exit(main())
