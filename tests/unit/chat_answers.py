"""Chat plans and the text deltas that answer them, for the tests of chat answers (tool
calls, reasoning): one plan of a body, one delta of a piece of text, or a whole answer
of known tokens; and streamed events read back as a client reads them."""

from __future__ import annotations

import json
from typing import Any

from radixserve.api import parse_body, plan_chat
from radixserve.api.mapping import GenerationPlan
from radixserve.api.openai_models import ChatCompletionRequest
from radixserve.protocol import FinishReason, TextDelta, pack_tokens


def chat_plan(body: dict[str, Any], reasoning_parser: str | None = None) -> GenerationPlan:
    """The gateway's plan of a chat body (response id `id-1`)."""
    return plan_chat(
        parse_body(ChatCompletionRequest, json.dumps(body).encode()),
        response_id="id-1",
        gateway_id="gw",
        served_model="m",
        arrival_time=0.0,
        reasoning_parser=reasoning_parser,
    )


def text_delta(text: str, finish: FinishReason | None = None, index: int = 0) -> TextDelta:
    """One piece of choice `index`'s answer (one token), ending it with `finish`."""
    return TextDelta(
        rid="id-1",
        text=text,
        token_ids=pack_tokens([1]),
        index=index,
        finish_reason=finish,
        prompt_tokens=3,
        completion_tokens=1,
    )


def token_deltas(
    pieces: list[list[str]], index: int = 0, finish: FinishReason | None = None
) -> list[TextDelta]:
    """Choice `index`'s answer as deltas, one a piece, each piece the texts of its tokens,
    with running counters; the last delta ends the answer with `finish` (default stop)."""
    deltas, sent = [], 0
    end = finish or FinishReason(kind="stop")
    for i, texts in enumerate(pieces):
        ids = list(range(sent, sent + len(texts)))
        sent += len(texts)
        deltas.append(
            TextDelta(
                rid="id-1",
                text="".join(texts),
                token_ids=pack_tokens(ids),
                index=index,
                finish_reason=end if i == len(pieces) - 1 else None,
                prompt_tokens=3,
                completion_tokens=sent,
            )
        )
    return deltas


def sse_payloads(events: list[bytes]) -> list[dict[str, Any]]:
    """Server-sent events (`data: <json>` and a blank line each) -> their JSON payloads."""
    out = []
    for raw in events:
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
        out.append(json.loads(raw[len(b"data: ") : -2]))
    return out
