"""One streamed request to the server under test, timed token by token.

    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        result = await send_request(http, RequestSpec(...), backend="openai")

Backends: `openai` streams `POST /v1/completions` (any OpenAI-compatible server:
radixserve, vLLM, SGLang, llama.cpp) with `stream_options.include_usage`, reading
`usage.prompt_tokens_details.cached_tokens` when the server reports it; `radixserve`
streams SGLang's native `POST /generate` (radixserve and SGLang), reading `meta_info`.
A token's time is when the chunk that carries it arrives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Backend = Literal["openai", "radixserve"]


@dataclass(frozen=True)
class RequestSpec:
    model: str
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    ignore_eos: bool = True


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # what the dataset sent (server's count when it reported one)
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    error: str = ""


def sse_data(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON payloads of an SSE stream's `data:` lines, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        if payload:
            yield json.loads(payload)


class _Timer:
    """Chunk arrival times: TTFT at the first, then the gaps."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0

    def tick(self, result: RequestResult) -> None:
        now = time.perf_counter()
        if self.last is None:
            result.ttft = now - self.started
        else:
            result.itl.append(now - self.last)
        self.last = now
        self.chunks += 1


async def send_request(
    http: httpx.AsyncClient, spec: RequestSpec, backend: Backend
) -> RequestResult:
    result = RequestResult(prompt_len=spec.prompt_len)
    timer = _Timer()
    try:
        if backend == "openai":
            await _openai(http, spec, result, timer)
        else:
            await _native(http, spec, result, timer)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - timer.started
    result.success = timer.chunks > 0
    if not result.success and not result.error:
        result.error = "the stream carried no token"
    return result


async def _openai(
    http: httpx.AsyncClient, spec: RequestSpec, result: RequestResult, timer: _Timer
) -> None:
    body: dict[str, Any] = {
        "model": spec.model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang and radixserve take it
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            for chunk in sse_data([line]):
                if "error" in chunk:
                    raise ValueError(f"stream error: {chunk['error']}")
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    timer.tick(result)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
    if not result.output_tokens:
        result.output_tokens = timer.chunks  # no usage: one chunk per token, as a guess


async def _native(
    http: httpx.AsyncClient, spec: RequestSpec, result: RequestResult, timer: _Timer
) -> None:
    body: dict[str, Any] = {
        "sampling_params": {
            "max_new_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": spec.ignore_eos,
        },
        "stream": True,
    }
    body["text" if isinstance(spec.prompt, str) else "input_ids"] = spec.prompt
    async with http.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            for event in sse_data([line]):
                if "error" in event:
                    raise ValueError(f"stream error: {event['error']}")
                meta = event.get("meta_info") or {}
                completion = int(meta.get("completion_tokens", 0))
                if completion > result.output_tokens:  # each event holds everything so far
                    timer.tick(result)
                    result.output_tokens = completion
                result.prompt_len = int(meta.get("prompt_tokens", result.prompt_len))
                if meta.get("cached_tokens") is not None:
                    result.cached_tokens = int(meta["cached_tokens"])
