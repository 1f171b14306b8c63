"""Does the stack stay up under a long mixed load? A soak: leaks, errors, lost KV.

Starts a stack (NATS, Redis, the six services as `radixserve up` starts them, one
worker), then keeps `--concurrency` requests in flight for `--minutes`, cycling
through six kinds through the official `openai` client and httpx: chat, chat streamed
(half of those streams closed by the client after three chunks), chat with `n` 2 over a
shared system prompt, a `json_schema` response format, completions with logprobs, and
the native `/generate`. Every `--interval-s` it samples each service's resident memory
(the service and its child processes: the grammar service's compile processes), and at
the end it reads the worker's running requests and KV use, which must be back at 0.

What a leak looks like: a service whose memory keeps growing sample after sample; the
growth reported runs from the second sample (the first under load, past the first
requests' one-time allocations) to the last.
Exit code 1 if a request failed, a service died, or the worker kept a request or KV
after the load.

    python bench/soak.py --minutes 10                   # the embedded SmolLM2 on the CPU
    python bench/soak.py --model DIR --minutes 0.5 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from common import start_local_stack
from openai import AsyncOpenAI

from radixserve.infra import Infra
from radixserve.model_files.paths import resolve_model_path
from radixserve.stack import Stack

MODEL = "soak"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho".split()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its descendants (/proc), in MiB."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
    return total / 1024


class Load:
    """The mixed requests, and what became of them (by kind)."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.client = AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
        self.http = httpx.AsyncClient(base_url=url, timeout=300)
        self.rng = rng
        self.done: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.streams_cut = 0

    def prompt(self) -> str:
        words = self.rng.choices(WORDS, k=self.rng.randint(5, 60))
        return " ".join(words) + f" {self.rng.random():.6f}"  # unique: the cache grows

    async def one(self, index: int) -> None:
        kinds = (self.chat, self.stream, self.shared_n, self.schema, self.completion, self.native)
        kind = kinds[index % len(kinds)]
        try:
            await kind(index)
            self.done[kind.__name__] += 1
        except Exception as exc:  # counted: the soak reports every failure
            self.errors[
                f"{kind.__name__}: {type(exc).__name__} {getattr(exc, 'status_code', '')}"
            ] += 1

    async def chat(self, _: int) -> None:
        messages = [{"role": "user", "content": self.prompt()}]
        await self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)  # type: ignore[arg-type]

    async def stream(self, _: int) -> None:
        messages = [{"role": "user", "content": self.prompt()}]
        stream = await self.client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=48,
            stream=True,
        )
        cut, chunks = self.rng.random() < 0.5, 0
        async for _chunk in stream:
            chunks += 1
            if cut and chunks == 3:
                await stream.close()  # the client goes away mid-stream
                self.streams_cut += 1
                break

    async def shared_n(self, index: int) -> None:
        messages = [
            {"role": "system", "content": "You answer in one short line. " * 20},
            {"role": "user", "content": self.prompt()},
        ]
        await self.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            n=2,
            temperature=0.8,
            seed=index,  # type: ignore[arg-type]
        )

    async def schema(self, _: int) -> None:
        reply = await self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "A person, as JSON."}],
            max_tokens=64,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        if reply.choices[0].finish_reason == "stop":  # complete: it must parse
            json.loads(reply.choices[0].message.content or "")

    async def completion(self, _: int) -> None:
        await self.client.completions.create(
            model=MODEL, prompt=self.prompt(), max_tokens=20, logprobs=2
        )

    async def native(self, _: int) -> None:
        body = {"text": self.prompt(), "sampling_params": {"max_new_tokens": 12}}
        (await self.http.post("/generate", json=body)).raise_for_status()

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()


async def soak(
    stack: Stack, url: str, seconds: float, concurrency: int, interval_s: float, seed: int
) -> dict[str, Any]:
    load = Load(url, random.Random(seed))
    pids = {s.name: s.process.pid for s in stack.services if s.process.pid is not None}
    samples: list[dict[str, Any]] = []

    def sample(elapsed: float) -> None:
        row = {"s": round(elapsed), "requests": sum(load.done.values())}
        row |= {name: round(rss_mb(pid)) for name, pid in pids.items()}
        samples.append(row)
        print(json.dumps(row | {"errors": sum(load.errors.values())}), file=sys.stderr)

    started = time.monotonic()
    next_sample = started
    counter = itertools.count()

    async def lane() -> None:
        while time.monotonic() - started < seconds:
            await load.one(next(counter))

    lanes = [asyncio.create_task(lane()) for _ in range(concurrency)]
    while not all(task.done() for task in lanes):
        if time.monotonic() >= next_sample:
            sample(time.monotonic() - started)
            next_sample += interval_s
        await asyncio.sleep(0.2)
    await asyncio.gather(*lanes)
    sample(time.monotonic() - started)
    await load.close()
    return {
        "requests": dict(load.done),
        "errors": dict(load.errors),
        "streams_cut": load.streams_cut,
        "rss_mb": samples,
    }


def worker_left(metrics_url: str, wait_s: float = 30.0) -> dict[str, float]:
    """The worker's running requests and KV use once the load is over (waits for the
    aborts of cut streams to land)."""
    deadline = time.monotonic() + wait_s
    while True:
        found: dict[str, float] = {}
        for line in httpx.get(metrics_url, timeout=10).text.splitlines():
            name = line.partition("{")[0].split(" ")[0]
            if name in ("radixserve:num_running_reqs", "radixserve:token_usage"):
                found[name.split(":")[1]] = float(line.rsplit(" ", 1)[-1])
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--worker-args", default="", help="more worker flags")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--interval-s", type=float, default=60.0, help="between memory samples")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18135)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()

    model_dir = resolve_model_path(args.model)
    worker_args = ["--device", args.device, *args.worker_args.split()]
    with Infra() as infra:
        stack = start_local_stack(infra, "soak", args.port, model_dir, MODEL, worker_args)
        spec = stack.spec
        try:
            stack.wait_healthy(900)
            metrics_url = f"http://127.0.0.1:{spec.metrics_ports()['worker-0']}/metrics"
            seconds = args.minutes * 60
            report = asyncio.run(
                soak(stack, spec.url, seconds, args.concurrency, args.interval_s, args.seed)
            )
            report["worker_left"] = worker_left(metrics_url)
            report["down"] = [s.name for s in stack.services if not s.process.alive]
        finally:
            stack.stop()

    report["settings"] = {"model": str(model_dir), "device": args.device} | {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
    }
    first, last = report["rss_mb"][min(1, len(report["rss_mb"]) - 1)], report["rss_mb"][-1]
    report["rss_growth_mb"] = {
        name: last[name] - first[name] for name in last if name not in ("s", "requests")
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("requests", "errors", "worker_left", "down")}))
    print(f"memory growth after the first sample (MiB): {json.dumps(report['rss_growth_mb'])}")
    clean = not report["errors"] and not any(report["worker_left"].values()) and not report["down"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
