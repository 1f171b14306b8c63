"""Logprob entries from the detokenizer -> the three shapes clients expect.

- chat (OpenAI): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`
- completions (OpenAI legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`
- `/generate` (SGLang `meta_info`): `output_token_logprobs` = `[[logprob, id, text]]`,
  `output_top_logprobs` = one such list per position; with `logprob_start_len`, the
  prompt's `input_token_logprobs` / `input_top_logprobs` too (completions: with `echo`).

JSON has no -inf: a logprob that is not finite (a candidate with zero probability)
is reported as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixserve.protocol import LogprobEntry, PromptLogprobEntries

FLOOR_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": finite(e.logprob),
                "bytes": _token_bytes(e.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": finite(t.logprob), "bytes": _token_bytes(t.token)}
                    for t in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[LogprobEntry], start_offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy shape and the text offset after the last token (for the next chunk).

    `text_offset` counts characters of the choice's text from `start_offset` (the
    echoed prompt's length, or where the previous chunk ended)."""
    offsets: list[int] = []
    offset = start_offset
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    body = {
        "tokens": [e.token for e in entries],
        "token_logprobs": [finite(e.logprob) for e in entries],
        "top_logprobs": [{t.token: finite(t.logprob) for t in e.top} for e in entries],
        "text_offset": offsets,
    }
    return body, offset


def echo_logprobs(prompt: PromptLogprobEntries) -> dict[str, Any]:
    """The echoed prompt's tokens in the legacy shape (text offsets from 0); the first
    token has no logprob (null, as OpenAI reports it)."""
    entries = ([prompt.head] if prompt.head is not None else []) + list(prompt.entries)
    head = prompt.head is not None
    body, _ = completion_logprobs(entries, 0)
    if head:
        body["token_logprobs"][0] = None
        body["top_logprobs"][0] = None
    return body


def prepend_logprobs(prompt: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The echoed prompt's legacy logprobs ahead of the completion's."""
    return {key: prompt[key] + body[key] for key in body}


def input_logprobs(prompt: PromptLogprobEntries, with_top: bool) -> dict[str, Any]:
    """SGLang's `meta_info.input_token_logprobs` (and `input_top_logprobs`): `[logprob,
    id, text]` per prompt token from `logprob_start_len` on, the first token's logprob
    null."""
    tokens: list[list[Any]] = []
    tops: list[Any] = []
    if prompt.head is not None:
        tokens.append([None, prompt.head.token_id, prompt.head.token])
        tops.append(None)
    for e in prompt.entries:
        tokens.append([finite(e.logprob), e.token_id, e.token])
        tops.append([[finite(t.logprob), t.token_id, t.token] for t in e.top])
    body: dict[str, Any] = {"input_token_logprobs": tokens}
    if with_top:
        body["input_top_logprobs"] = tops
    return body


def generate_logprobs(entries: Sequence[LogprobEntry], with_top: bool) -> dict[str, Any]:
    """SGLang's `meta_info` logprob fields."""
    body: dict[str, Any] = {
        "output_token_logprobs": [[finite(e.logprob), e.token_id, e.token] for e in entries]
    }
    if with_top:
        body["output_top_logprobs"] = [
            [[finite(t.logprob), t.token_id, t.token] for t in e.top] for e in entries
        ]
    return body
