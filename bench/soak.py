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

Fault mode (`--fault-interval-s S`): on NATS and Redis servers of its own, a SIGKILL of
one of `--fault-targets` every S seconds (each target in turn, in a shuffled order; a
worker: any one), restarted by the stack's supervisor as `radixserve up` does, under a
mixed load from clients that resume what a cut connection lost (common/faults.py:
greedy and seeded streams, sampled chats, JSON-schema chats, completions with logprobs).
It reports requests, completed, failed by code, lost (no answer and no code: a bug),
the scheduler's migrations by reason (summed over its restarts), stream TTFT p50/p99
within `--fault-window-s` after a kill and outside, and each kill's restart and
recovery (to the first request sent after it that completed). Exit code 1 if a request
was lost, a service stayed down or a worker kept a request or KV after the load.

    python bench/soak.py --minutes 10                   # the embedded SmolLM2 on the CPU
    python bench/soak.py --model DIR --minutes 0.5 --json soak.json
    python bench/soak.py --model DIR --workers 2 --minutes 10 --fault-interval-s 60
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from common import start_local_stack
from common.faults import (
    PERSON,
    WORDS,
    CounterScrape,
    FaultLoad,
    Faults,
    parse_targets,
    summary,
    supervise,
)
from openai import AsyncOpenAI

from radixserve.infra import Infra, InfraSettings
from radixserve.model_files.paths import resolve_model_path
from radixserve.stack import Stack

MODEL = "soak"
ALL_TARGETS = "worker,scheduler,detokenizer,gateway,tokenizer,nats,redis"


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


@dataclass(frozen=True)
class FaultPlan:
    targets: list[str]
    interval_s: float
    window_s: float  # a stream started this soon after a kill is "during faults"
    deadline_s: float  # a request unanswered this long is lost


async def fault_soak(
    stack: Stack, seconds: float, concurrency: int, plan: FaultPlan, seed: int
) -> dict[str, Any]:
    """The mixed load from resuming clients for `seconds`, a kill every interval."""
    started = time.monotonic()
    until = started + seconds
    migrated = [
        CounterScrape(f"http://127.0.0.1:{port}/metrics", "radixserve:requests_migrated_total")
        for name, port in stack.spec.metrics_ports().items()
        if name.startswith("scheduler-")
    ]
    stop_supervising = asyncio.Event()
    supervisor = asyncio.create_task(supervise(stack, stop_supervising))
    faults = Faults(stack, plan.targets, plan.interval_s, plan.window_s, seed)
    async with httpx.AsyncClient(base_url=stack.spec.url, timeout=httpx.Timeout(60.0)) as http:
        load = FaultLoad(http, MODEL, random.Random(seed), plan.deadline_s)
        counter = itertools.count()

        async def lane() -> None:
            while time.monotonic() < until:
                await load.one(next(counter))

        lanes = [asyncio.create_task(lane()) for _ in range(concurrency)]
        killing = asyncio.create_task(faults.run(until))
        while not all(task.done() for task in lanes):
            for scrape in migrated:
                await asyncio.to_thread(scrape.scrape)
            await asyncio.sleep(2.0)
        await asyncio.gather(*lanes, killing)
    stop_supervising.set()
    await supervisor
    by_reason: Counter[str] = Counter()
    for scrape in migrated:
        await asyncio.to_thread(scrape.scrape)
        for labels, count in scrape.total.items():
            by_reason[labels.partition('reason="')[2].partition('"')[0]] += round(count)
    report = summary(load.outcomes, faults.kills, plan.window_s, started)
    report["refused_connect"] = load.refused_connect
    report["resent"] = load.resent
    report["resumes"] = load.resumes
    report["migrated"] = dict(by_reason)
    return report


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
    ap.add_argument("--workers", type=int, default=1, help="workers (2: a killed one's migrate)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--interval-s", type=float, default=60.0, help="between memory samples")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18135)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    faults = ap.add_argument_group("fault mode")
    faults.add_argument(
        "--fault-interval-s",
        type=float,
        default=0.0,
        help="SIGKILL one process this often, restarted by the stack's supervisor (0: off)",
    )
    faults.add_argument(
        "--fault-targets", default=ALL_TARGETS, help=f"what may be killed (default {ALL_TARGETS})"
    )
    faults.add_argument(
        "--fault-window-s",
        type=float,
        default=10.0,
        help="a stream started this soon after a kill counts as during faults",
    )
    faults.add_argument(
        "--request-deadline-s",
        type=float,
        default=120.0,
        help="a request unanswered this long is lost",
    )
    args = ap.parse_args()
    if args.workers < 1 or args.concurrency < 1 or args.minutes <= 0:
        ap.error("--workers and --concurrency must be >= 1, --minutes > 0")

    model_dir = resolve_model_path(args.model)
    worker_args = ["--device", args.device, *args.worker_args.split()]
    settings = {"model": str(model_dir), "device": args.device} | {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "workers": args.workers,
    }
    if args.fault_interval_s > 0:
        try:
            targets = parse_targets(args.fault_targets)
        except ValueError as exc:
            ap.error(str(exc))
        plan = FaultPlan(
            targets, args.fault_interval_s, args.fault_window_s, args.request_deadline_s
        )
        return run_faults(args, model_dir, worker_args, plan, settings)
    return run_soak(args, model_dir, worker_args, settings)


def run_soak(
    args: argparse.Namespace, model_dir: Path, worker_args: list[str], settings: dict[str, Any]
) -> int:
    with Infra() as infra:
        stack = start_local_stack(
            infra, "soak", args.port, model_dir, MODEL, worker_args, args.workers
        )
        spec = stack.spec
        try:
            stack.wait_healthy(900)
            seconds = args.minutes * 60
            report = asyncio.run(
                soak(stack, spec.url, seconds, args.concurrency, args.interval_s, args.seed)
            )
            report["worker_left"] = workers_left(stack)
            report["down"] = [s.name for s in stack.services if not s.process.alive]
        finally:
            stack.stop()

    report["settings"] = settings
    first, last = report["rss_mb"][min(1, len(report["rss_mb"]) - 1)], report["rss_mb"][-1]
    report["rss_growth_mb"] = {
        name: last[name] - first[name] for name in last if name not in ("s", "requests")
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("requests", "errors", "worker_left", "down")}))
    print(f"memory growth after the first sample (MiB): {json.dumps(report['rss_growth_mb'])}")
    clean = not report["errors"] and not any_left(report["worker_left"]) and not report["down"]
    return 0 if clean else 1


def run_faults(
    args: argparse.Namespace,
    model_dir: Path,
    worker_args: list[str],
    plan: FaultPlan,
    settings: dict[str, Any],
) -> int:
    """Exit code 1 if a request was lost, a service stayed down, or a worker kept a
    request or KV after the load; failures with a code are what faults cause."""
    # Servers of its own, without credentials (loopback): killing them touches no one else's.
    with Infra(InfraSettings(auth=False)) as infra:
        stack = start_local_stack(
            infra, "faults", args.port, model_dir, MODEL, worker_args, args.workers
        )
        stack.adopt(infra.local_servers())
        try:
            stack.wait_healthy(900)
            report = asyncio.run(
                fault_soak(stack, args.minutes * 60, args.concurrency, plan, args.seed)
            )
            stack.wait_healthy(300)  # the last kill's restart
            report["worker_left"] = workers_left(stack)
            report["down"] = [s.name for s in stack.services if not s.process.alive]
        finally:
            stack.stop()
    report["settings"] = settings | {
        "fault_targets": plan.targets,
        "fault_interval_s": plan.interval_s,
        "fault_window_s": plan.window_s,
        "request_deadline_s": plan.deadline_s,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    shown = ("requests", "completed", "failed", "lost", "migrated", "ttft_s", "worker_left")
    print(json.dumps({k: report[k] for k in shown}))
    clean = not report["lost"] and not any_left(report["worker_left"]) and not report["down"]
    return 0 if clean else 1


def workers_left(stack: Stack) -> dict[str, dict[str, float]]:
    ports = stack.spec.metrics_ports()
    return {
        name: worker_left(f"http://127.0.0.1:{port}/metrics")
        for name, port in ports.items()
        if name.startswith("worker-")
    }


def any_left(left: dict[str, dict[str, float]]) -> bool:
    return any(any(values.values()) for values in left.values())


if __name__ == "__main__":
    sys.exit(main())
