"""`radixserve chat`: a terminal chat over a running gateway's OpenAI API (streaming)."""

from __future__ import annotations

import json
import sys

import httpx


def stream_reply(
    client: httpx.Client,
    url: str,
    history: list[dict[str, str]],
    max_tokens: int,
    temperature: float,
) -> str:
    """Send the conversation, print the reply as it streams, return it whole."""
    body = {
        "model": "",
        "messages": history,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    parts: list[str] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                parts.append(text)
                print(text, end="", flush=True)
    print()
    return "".join(parts)


def run_chat(url: str, max_tokens: int, temperature: float) -> int:
    url = url.rstrip("/")
    history: list[dict[str, str]] = []
    with httpx.Client(timeout=httpx.Timeout(10.0, read=300.0)) as client:
        try:
            health = client.get(f"{url}/health/ready")
        except httpx.HTTPError as exc:
            print(
                f"radixserve chat: no gateway at {url} ({exc}); start one with `make run`",
                file=sys.stderr,
            )
            return 1
        if health.status_code != 200:
            try:
                missing = ", ".join(health.json().get("missing", []))
            except ValueError:  # not a radixserve gateway's body
                missing = ""
            missing = missing or f"HTTP {health.status_code}"
            print(f"radixserve chat: {url} is not ready (waiting for: {missing})", file=sys.stderr)
            return 1
        print(f"Chatting with {url}. Ctrl-D or Ctrl-C to quit.")
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            print("model> ", end="", flush=True)
            try:
                reply = stream_reply(client, url, history, max_tokens, temperature)
            except (httpx.HTTPError, RuntimeError) as exc:
                print(f"\nradixserve chat: {exc}", file=sys.stderr)
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})
