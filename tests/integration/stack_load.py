"""The clients of the stack tests: streamed completions sent in a loop while services fail
(`Load`), each ending as an `Outcome` (finished with its text, failed with the error code
the client read, or lost), and one stream's SSE events read as they come (`Events`).

    load = Load(url, [body("Load 0: the numbers go", 40)], clients=1, deadline_s=60.0)
    task = asyncio.create_task(load.run()); ...; load.stop.set(); await task
    kinds = Counter(o.kind for o in load.outcomes)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


def body(prompt: str, max_tokens: int, *, usage: bool = True, **fields: Any) -> dict[str, Any]:
    """A streamed completion for the stack's model that runs its full `max_tokens`
    (ignore_eos), greedy unless `fields` say otherwise; `usage`: ask for the usage chunk."""
    request: dict[str, Any] = {
        "model": "test-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **fields,
    }
    if usage:
        request["stream_options"] = {"include_usage": True}
    return request


@dataclass
class Outcome:
    index: int  # of the request sent, in its load's bodies
    kind: str  # finished, failed, lost
    text: str = ""
    code: str = ""  # failed: the error's code; lost: how
    usage: int = 0  # completion tokens, when the usage chunk was asked for
    started_at: float = 0.0
    ended_at: float = 0.0


async def one_request(
    http: httpx.AsyncClient,
    request: dict[str, Any],
    index: int,
    deadline_s: float,
    resume: bool = False,
) -> Outcome:
    """`request` streamed to [DONE] or its error; lost if not done within `deadline_s`.
    `resume`: a stream cut or refused (its gateway killed) is sent again, with the last
    event id it had, as a resuming client does; without it a cut stream is lost."""
    started = time.monotonic()
    texts: list[str] = []
    usage = 0
    last_id: str | None = None

    def ended(kind: str, code: str = "") -> Outcome:
        return Outcome(index, kind, "".join(texts), code, usage, started, time.monotonic())

    try:
        async with asyncio.timeout(deadline_s):
            while True:
                headers = {} if last_id is None else {"Last-Event-ID": last_id}
                try:
                    async with http.stream(
                        "POST", "/v1/completions", json=request, headers=headers
                    ) as reply:
                        if reply.status_code != 200:
                            return ended("failed", json.loads(await reply.aread())["error"]["code"])
                        async for line in reply.aiter_lines():
                            if line.startswith("id: "):
                                last_id = line[4:]
                            elif line == "data: [DONE]":
                                return ended("finished")
                            elif line.startswith("data: "):
                                chunk = json.loads(line[6:])
                                if "error" in chunk:
                                    return ended("failed", chunk["error"]["code"])
                                if chunk.get("usage"):
                                    usage = chunk["usage"]["completion_tokens"]
                                texts += [c["text"] for c in chunk["choices"] if c.get("text")]
                except httpx.TransportError as exc:
                    if not resume:
                        return ended("lost", f"connection: {exc!r}")
                if not resume:
                    return ended("lost", "the stream ended without [DONE]")
                if last_id is None and texts:
                    return ended("lost", "cut, not resumable")
                await asyncio.sleep(0.3)  # the gateway is not back yet
    except TimeoutError:
        return ended("lost", "no answer by the deadline")


@dataclass
class Load:
    """`clients` clients streaming `one_request`s until `stop`: client c sends bodies c,
    c + clients, ... round the list; every outcome is kept."""

    url: str
    bodies: list[dict[str, Any]]
    clients: int
    deadline_s: float
    resume: bool = False
    read_timeout_s: float = 30.0
    retry_pause_s: float = 0.3  # after a failure, as a client honouring Retry-After would
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        timeout = httpx.Timeout(self.read_timeout_s)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, c) for c in range(self.clients)))

    async def send(self, http: httpx.AsyncClient, index: int) -> Outcome:
        """bodies[index], once, as the load's clients send it."""
        return await one_request(http, self.bodies[index], index, self.deadline_s, self.resume)

    async def _client(self, http: httpx.AsyncClient, client: int) -> None:
        index = client
        while not self.stop.is_set():
            outcome = await self.send(http, index % len(self.bodies))
            self.outcomes.append(outcome)
            index += self.clients
            if outcome.kind == "failed":
                await asyncio.sleep(self.retry_pause_s)

    def succeeded_after(self, moment: float) -> bool:
        return any(o.kind == "finished" and o.started_at > moment for o in self.outcomes)


@dataclass
class Events:
    """An SSE answer as read: each text event's text and the event id it came under, the
    last id seen, the usage, whether [DONE] came, the request's id."""

    texts: list[str] = field(default_factory=list)
    ids: list[str | None] = field(default_factory=list)
    last_id: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    rid: str = ""

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def read_events(
    lines: AsyncIterator[str], events: Events, cut: Callable[[Events], bool] | None = None
) -> Events:
    """The SSE `lines` into `events`, until [DONE], or until `cut` (asked after each data
    event) says to hang up. An error event fails the test."""
    async for line in lines:
        if line.startswith("id: "):
            events.last_id = line[4:]
        elif line == "data: [DONE]":
            events.done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                events.usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice.get("text"):
                    events.texts.append(choice["text"])
                    events.ids.append(events.last_id)
            if cut is not None and cut(events):
                return events
    return events
