"""The soak's fault mode (bench/soak.py --fault-interval-s): a mixed load from resuming
clients, a SIGKILL of one process every interval (the stack's supervisor restarts it),
and what became of every request.

The clients speak plain HTTP (httpx), as a careful client would: a stream cut by the
gateway's death is re-POSTed with the last event id it had (`Last-Event-ID`); a
non-streaming request is sent with `X-Resumable: true` and its own `X-Request-Id`, and
fetched after a cut with `GET /v1/requests/{id}/output`; after a failure the client waits
the reply's `Retry-After` (1 s when none, 5 s at most). Each request ends one way:

- completed: its answer (a stream to `[DONE]`; a JSON schema's output parses),
- failed: an HTTP error or an SSE error event, counted by its code,
- lost: no answer by the deadline, with no code: a bug.

A request refused at connect (no gateway listening) was never admitted: it is sent again
and counted as `refused_connect`, not as a request. Sent again too (`resent`): a stream
cut before its first event (nothing to resume from), and a request whose resume the
gateway answers 404 (the gateway died before it recorded the request).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from radixserve.stack import Stack, Supervised

# --fault-targets names -> the stack's children (a worker: any one of them).
TARGETS = {
    "worker": "worker-",
    "scheduler": "scheduler-",
    "detokenizer": "detokenizer-",
    "gateway": "gateway-",
    "tokenizer": "tokenizer-",
    "grammar": "grammar-",
    "nats": "nats-server",
    "redis": "redis-server",
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho".split()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
KINDS = ("stream_greedy", "stream_seeded", "chat", "schema", "completion")


def parse_targets(text: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(targets) - TARGETS.keys())
    if unknown or not targets:
        raise ValueError(f"--fault-targets: unknown {unknown} (known: {', '.join(TARGETS)})")
    return targets


@dataclass
class Outcome:
    kind: str
    result: str  # completed, failed, lost
    started: float
    ended: float
    code: str = ""
    ttft_s: float | None = None  # streams: to the first text
    rid: str = ""


@dataclass
class FaultLoad:
    """Requests of the five kinds in turn from resuming clients; their outcomes."""

    http: httpx.AsyncClient
    model: str
    rng: random.Random
    deadline_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    refused_connect: int = 0
    resent: int = 0
    resumes: int = 0

    def prompt(self) -> str:
        words = self.rng.choices(WORDS, k=self.rng.randint(5, 60))
        return " ".join(words) + f" {self.rng.random():.6f}"  # unique: the cache grows

    def request(self, index: int) -> tuple[str, str, dict[str, Any], bool]:
        """(kind, path, body, stream) of the index-th request."""
        kind = KINDS[index % len(KINDS)]
        chat = {"model": self.model, "messages": [{"role": "user", "content": self.prompt()}]}
        if kind == "stream_greedy":
            return kind, "/v1/chat/completions", chat | _stream(48, temperature=0), True
        if kind == "stream_seeded":
            body = {"model": self.model, "prompt": self.prompt(), "seed": index, "top_k": 20}
            return kind, "/v1/completions", body | _stream(48, temperature=0.8), True
        if kind == "chat":
            return kind, "/v1/chat/completions", chat | {"max_tokens": 24}, False
        if kind == "schema":
            schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            body = chat | {"max_tokens": 64, "temperature": 0, "response_format": schema}
            return kind, "/v1/chat/completions", body, False
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 20, "logprobs": 2}
        return kind, "/v1/completions", body | {"temperature": 0}, False

    async def one(self, index: int) -> None:
        kind, path, body, stream = self.request(index)
        rid = f"soak-{index}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        call = _Call(self, rid, path, body, stream, started)
        result, code = await call.run()
        self.outcomes.append(
            Outcome(kind, result, started, time.monotonic(), code, call.first_text, rid)
        )
        await asyncio.sleep(call.retry_after_s)


def _stream(max_tokens: int, **sampling: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "stream": True, **sampling}


@dataclass
class _Call:
    """One request to its end: sent, then resumed after each cut connection."""

    load: FaultLoad
    rid: str
    path: str
    body: dict[str, Any]
    stream: bool
    started: float
    sent: bool = False  # the POST got past connect: from now on, resume it
    last_event_id: str | None = None
    first_text: float | None = None
    retry_after_s: float = 0.0

    async def run(self) -> tuple[str, str]:
        """(result, code)."""
        deadline = self.started + self.load.deadline_s
        while time.monotonic() < deadline:
            resuming = self.sent
            if resuming and self.stream and self.last_event_id is None:
                self.load.resent += 1  # cut before its first event: nothing to resume
                resuming = self.sent = False
            self.load.resumes += resuming
            try:
                reply = await self.load.http.send(self._next_request(), stream=True)
            except httpx.ConnectError:  # no gateway listening (yet)
                self.load.refused_connect += 0 if resuming else 1
                await asyncio.sleep(0.5)
                continue
            except httpx.TransportError:
                self.sent = True  # it may have got in: ask for it
                await asyncio.sleep(0.3)
                continue
            self.sent = True
            try:
                ended = await self._read(reply, resuming)
            except httpx.TransportError:
                ended = None  # cut mid-answer: resume
            finally:
                await reply.aclose()
            if ended is not None:
                return ended
            await asyncio.sleep(0.3)
        return "lost", "no answer by the deadline"

    def _next_request(self) -> httpx.Request:
        """The POST; then a stream's resume (re-POSTed with its Last-Event-ID, which works
        while Redis is down too) or a named request's (GET its output)."""
        http = self.load.http
        if self.stream:
            last = self.last_event_id
            headers = {"Last-Event-ID": last} if self.sent and last is not None else {}
            return http.build_request("POST", self.path, json=self.body, headers=headers)
        if not self.sent:
            headers = {"X-Resumable": "true", "X-Request-Id": self.rid}
            return http.build_request("POST", self.path, json=self.body, headers=headers)
        return http.build_request("GET", f"/v1/requests/{self.rid}/output")

    async def _read(self, reply: httpx.Response, resuming: bool) -> tuple[str, str] | None:
        """The request's end, or None when the connection ended before it."""
        if reply.status_code == 404 and resuming and not self.stream:
            self.load.resent += 1  # the gateway died before it recorded the request
            self.sent = False
            return None
        if reply.status_code != 200:
            # As a client honouring Retry-After (the stack's 503s carry it) would.
            self.retry_after_s = min(float(reply.headers.get("retry-after", 1)), 5.0)
            return "failed", _error_code(await reply.aread(), reply.status_code)
        if not self.stream:
            answer = json.loads(await reply.aread())
            return _checked(self.body, answer)
        async for line in reply.aiter_lines():
            if line.startswith("id: "):
                self.last_event_id = line[4:]
            elif line == "data: [DONE]":
                return "completed", ""
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.retry_after_s = 1.0
                    return "failed", str(chunk["error"].get("code") or "error")
                if self.first_text is None and any(_text(c) for c in chunk.get("choices", [])):
                    self.first_text = time.monotonic() - self.started
        return None


def _text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def _error_code(body: bytes, status: int) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


def _checked(body: dict[str, Any], answer: dict[str, Any]) -> tuple[str, str]:
    """A finished structured answer must parse: one that does not is a failure to fix."""
    choice = answer["choices"][0]
    if "response_format" in body and choice.get("finish_reason") == "stop":
        try:
            json.loads(choice["message"]["content"] or "")
        except ValueError:
            return "failed", "invalid_structured_output"
    return "completed", ""


class CounterScrape:
    """A Prometheus counter family of one process, summed over its restarts (a value
    below the last one is a restarted process counting from 0; what a killed one
    counted after its last scrape is missed)."""

    def __init__(self, url: str, family: str) -> None:
        self.url, self.family = url, family
        self.last: dict[str, float] = {}
        self.total: dict[str, float] = {}

    def scrape(self) -> None:
        try:
            text = httpx.get(self.url, timeout=2).text
        except httpx.HTTPError:
            return  # restarting: the next scrape counts what it missed
        for line in text.splitlines():
            if not line.startswith(self.family + "{"):
                continue
            labels, value = line[len(self.family) :].rsplit(" ", 1)
            now = float(value)
            before = self.last.get(labels, 0.0)
            self.total[labels] = self.total.get(labels, 0.0) + (
                now - before if now >= before else now
            )
            self.last[labels] = now


@dataclass
class Kill:
    target: str
    at: float
    restarted_after_s: float | None = None


class Faults:
    """Every `interval_s`, SIGKILL one of `targets` (rounds of a shuffled order, so each
    is hit; none within `quiet_s` of the end, so each kill's recovery is seen), and note
    when the supervisor brought it back."""

    def __init__(
        self, stack: Stack, targets: list[str], interval_s: float, quiet_s: float, seed: int
    ) -> None:
        self.stack, self.interval_s, self.quiet_s = stack, interval_s, quiet_s
        rng = random.Random(seed)
        self.order = itertools.chain.from_iterable(
            rng.sample(targets, len(targets)) for _ in itertools.count()
        )
        self.rng = rng
        self.kills: list[Kill] = []

    def pick(self, target: str) -> Supervised[Any]:
        children: list[Supervised[Any]] = [*self.stack.servers, *self.stack.services]
        name = TARGETS[target]
        found = [c for c in children if c.name.startswith(name)]
        if not found:
            raise ValueError(f"--fault-targets {target}: the stack has no {name}")
        return self.rng.choice(found)

    async def run(self, until: float) -> None:
        while time.monotonic() + self.interval_s + self.quiet_s <= until:
            await asyncio.sleep(self.interval_s)
            target = next(self.order)
            item = self.pick(target)
            restarts = item.restarts
            item.process.kill()
            kill = Kill(item.name, time.monotonic())
            self.kills.append(kill)
            print(f"fault: killed {item.name}", file=sys.stderr)
            while item.restarts == restarts and time.monotonic() < until + 60:
                await asyncio.sleep(0.1)
            if item.restarts != restarts:
                kill.restarted_after_s = round(time.monotonic() - kill.at, 2)


async def supervise(stack: Stack, stop: asyncio.Event) -> None:
    """The stack's restarts, off the event loop (a server's restart waits for it)."""
    while not stop.is_set():
        await asyncio.to_thread(stack.supervise_once)
        await asyncio.sleep(0.2)


def summary(
    outcomes: list[Outcome], kills: list[Kill], window_s: float, started: float
) -> dict[str, Any]:
    """Counts, TTFT during faults (a stream waiting for its first text at some moment
    within `window_s` after a kill) and outside them, and each kill's recovery: to the
    first request sent after it that completed."""
    results = Counter(o.result for o in outcomes)
    failed = Counter(o.code for o in outcomes if o.result == "failed")
    by_kind = {kind: dict(Counter(o.result for o in outcomes if o.kind == kind)) for kind in KINDS}

    def during(o: Outcome) -> bool:
        first = o.started + (o.ttft_s or 0.0)
        return any(o.started <= k.at + window_s and first >= k.at for k in kills)

    ttfts: dict[str, list[float]] = {"during_faults": [], "outside": []}
    for o in outcomes:
        if o.ttft_s is not None and o.result == "completed":
            ttfts["during_faults" if during(o) else "outside"].append(o.ttft_s)
    kill_rows = []
    for k, following in zip(kills, [*kills[1:], None], strict=True):
        after = [o.ended - k.at for o in outcomes if o.result == "completed" and o.started > k.at]
        upto = following.at if following is not None else float("inf")
        codes = Counter(o.code for o in outcomes if o.result == "failed" and k.at <= o.ended < upto)
        kill_rows.append(
            {
                "target": k.target,
                "at_s": round(k.at - started, 1),
                "restarted_after_s": k.restarted_after_s,
                "recovered_after_s": round(min(after), 2) if after else None,
                "failed_until_next": dict(codes),  # ended between it and the next kill
            }
        )
    return {
        "requests": len(outcomes),
        "completed": results["completed"],
        "failed": dict(failed),
        "lost": results["lost"],
        "lost_requests": [o.rid for o in outcomes if o.result == "lost"][:20],
        "by_kind": by_kind,
        "ttft_s": {name: percentiles(values) for name, values in ttfts.items()},
        "kills": kill_rows,
    }


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(values), "p50": round(statistics.median(ordered), 3), "p99": round(p99, 3)}
