"""Server-sent events for streamed answers, one `ChoiceUpdate` at a time.

    streamer = make_streamer(plan, assembly, created)
    events = streamer.events(update, elapsed_s)   # encoded: b"data: {...}\n\n" each
    events = streamer.final(assembly)             # e.g. the usage chunk
    ... SSE_DONE

An OpenAI chunk's fields around its `choices` (id, object, created, model, and with
usage asked for `"usage": null`) are the same in every chunk of an answer: they are
encoded once, and each chunk encodes only its choices.

- chat: a first chunk with `role`, then `delta.content` chunks (and with tools a
  `delta.tool_calls` chunk per call), then a chunk with the finish reason and an
  empty delta (OpenAI's order);
- completions: `text` chunks (the echoed prompt ahead of the first), legacy
  logprobs with running `text_offset`, the finish reason on the last chunk;
- `/generate`: SGLang's events with the cumulative `text` and `output_ids` so far.

With `stream_options.include_usage`, every chunk has `"usage": null` and a last
chunk with no choices carries the usage (the non-streamed body's, `usage_body`).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from radixserve.api.assembly import Assembly, ChoiceUpdate
from radixserve.api.chat_tools import ToolStream
from radixserve.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prepend_logprobs,
)
from radixserve.api.mapping import GenerationPlan
from radixserve.api.responses import (
    chat_finish_reason,
    generate_output,
    openai_finish_reason,
    sse,
    usage_body,
)
from radixserve.chat_format.reasoning import ReasoningStream


class Streamer(Protocol):
    def events(self, update: ChoiceUpdate, elapsed_s: float) -> list[bytes]: ...

    def final(self, assembly: Assembly) -> list[bytes]: ...


class _OpenAIStreamer:
    object_name = ""

    def __init__(self, plan: GenerationPlan, created: int) -> None:
        self.plan = plan
        self.created = created
        self._started: set[int] = set()  # choices that got their first chunk
        fields = {"id": plan.response_id, "object": self.object_name, "created": created}
        fields["model"] = plan.model
        # `data: {"id":...,"model":...,"choices":` and what follows the choices.
        self._head = b"data: " + msgspec.json.encode(fields)[:-1] + b',"choices":'
        self._tail = b',"usage":null}\n\n' if plan.include_usage else b"}\n\n"

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        return self._head + msgspec.json.encode(choices) + self._tail

    def final(self, assembly: Assembly) -> list[bytes]:
        if not self.plan.include_usage:
            return []
        usage = msgspec.json.encode(usage_body(assembly.usage()))
        return [self._head + b'[],"usage":' + usage + b"}\n\n"]


class ChatStreamer(_OpenAIStreamer):
    """With tools, each choice's text goes through a `ToolStream`: content as soon as it
    cannot be part of a call, and its `tool_calls` entries (chat_tools.py)."""

    object_name = "chat.completion.chunk"

    def __init__(self, plan: GenerationPlan, created: int) -> None:
        super().__init__(plan, created)
        self._reasoning: dict[int, ReasoningStream] = {}
        self._tools: dict[int, ToolStream] = {}

    def events(self, update: ChoiceUpdate, elapsed_s: float) -> list[bytes]:
        index = update.choice.index
        delta = update.delta
        out: list[bytes] = []
        if index not in self._started:
            self._started.add(index)
            out.append(self._choice(index, {"role": "assistant", "content": ""}, None, None))
        last = delta.finish_reason is not None
        reasoning, text = self._think(index, delta.text, last)
        if reasoning:
            out.append(self._choice(index, {"reasoning_content": reasoning}, None, None))
        text, entries = self._read(index, text, last)
        if text or delta.logprobs:
            logprobs = chat_logprobs(delta.logprobs or []) if self.plan.logprobs else None
            out.append(self._choice(index, {"content": text}, logprobs, None))
        for entry in entries:
            out.append(self._choice(index, {"tool_calls": [entry]}, None, None))
        if delta.finish_reason is not None:
            tools = self._tools.get(index)
            called = tools is not None and tools.calls > 0
            reason = chat_finish_reason(delta.finish_reason, called)
            out.append(self._choice(index, {}, None, reason))
        return out

    def _think(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of a choice's next text (all content without a parser or
        with `separate_reasoning: false`)."""
        fmt = self.plan.reasoning_apart
        if fmt is None:
            return "", text
        stream = self._reasoning.get(index)
        if stream is None:
            stream = self._reasoning[index] = ReasoningStream(fmt)
        reasoning, content = stream.feed(text)
        if last:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _read(self, index: int, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, `tool_calls` entries) of a choice's next text."""
        if self.plan.tools is None:
            return text, []
        stream = self._tools.get(index)
        if stream is None:
            stream = self._tools[index] = self.plan.tools.stream()
        content, entries = stream.feed(text)
        if last:
            rest, more = stream.finish()
            content, entries = content + rest, entries + more
        return content, entries

    def _choice(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
    ) -> bytes:
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        )


class CompletionStreamer(_OpenAIStreamer):
    object_name = "text_completion"

    def __init__(self, plan: GenerationPlan, created: int) -> None:
        super().__init__(plan, created)
        self._offsets: dict[int, int] = {}  # per choice: text_offset of its next token

    def events(self, update: ChoiceUpdate, elapsed_s: float) -> list[bytes]:
        choice, delta = update.choice, update.delta
        text = delta.text
        if choice.index not in self._started:
            self._started.add(choice.index)
            if self.plan.echo_texts:
                text = self.plan.echo_texts[choice.prompt_index] + text
                self._offsets[choice.index] = len(self.plan.echo_texts[choice.prompt_index])
        logprobs = None
        if self.plan.logprobs:
            start = self._offsets.get(choice.index, 0)
            logprobs, self._offsets[choice.index] = completion_logprobs(delta.logprobs or [], start)
            if self.plan.echo_texts and delta.prompt_logprobs is not None:
                logprobs = prepend_logprobs(echo_logprobs(delta.prompt_logprobs), logprobs)
        if not text and not delta.logprobs and delta.finish_reason is None:
            return []
        return [
            self._chunk(
                [
                    {
                        "index": choice.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": openai_finish_reason(delta.finish_reason),
                    }
                ]
            )
        ]


class GenerateStreamer:
    """SGLang's stream: each event holds the whole text and ids so far."""

    def __init__(self, plan: GenerationPlan, assembly: Assembly) -> None:
        self.plan = plan
        self.assembly = assembly

    def events(self, update: ChoiceUpdate, elapsed_s: float) -> list[bytes]:
        delta = update.delta
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return []
        return [sse(generate_output(self.plan, self.assembly, update.choice, elapsed_s))]

    def final(self, assembly: Assembly) -> list[bytes]:
        return []


def make_streamer(plan: GenerationPlan, assembly: Assembly, created: int) -> Streamer:
    if plan.endpoint == "chat":
        return ChatStreamer(plan, created)
    if plan.endpoint == "completion":
        return CompletionStreamer(plan, created)
    return GenerateStreamer(plan, assembly)
