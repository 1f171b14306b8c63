"""A reasoning model's answer split into its reasoning and its content (`<think>` ... `</think>`).

    fmt = REASONING_FORMATS["qwen3"]                  # the gateway's --reasoning-parser
    reasoning, content = split_reasoning(text, fmt)   # a finished answer
    stream = ReasoningStream(fmt)
    reasoning_delta, content_delta = stream.feed(delta)   # a piece at a time, then finish()

OpenAI-compatible servers answer it as `message.reasoning_content` (streamed as
`delta.reasoning_content`) beside `content`, as SGLang's and vLLM's reasoning parsers do:
- `qwen3`: the model opens its reasoning itself: an answer that starts with `<think>` is
  reasoning up to `</think>`, any other is content only (thinking switched off);
- `deepseek-r1`: the chat template opens `<think>` in the prompt: the answer is
  reasoning up to `</think>` (all of it when the tag never comes), a `<think>` the
  model repeats at its start dropped.
An answer cut short inside its reasoning is reasoning only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened the reasoning: the answer begins inside it
    start: str = "<think>"
    end: str = "</think>"


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_inside=True),
}


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning, content) of a finished answer; reasoning None when there is none."""
    head = text.lstrip()
    if head.startswith(fmt.start):
        body = head[len(fmt.start) :]
    elif fmt.starts_inside:
        body = text
    else:
        return None, text
    end = body.find(fmt.end)
    if end < 0:
        return body.strip() or None, ""
    return body[:end].strip() or None, body[end + len(fmt.end) :].lstrip()


class ReasoningStream:
    """`split_reasoning` fed the answer in pieces: each `feed` returns the reasoning and
    the content it can tell apart so far; a piece that could be the start of a tag is
    held until the next one says. The joined pieces equal `split_reasoning`'s, up to the
    whitespace it strips."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._held = ""
        self._state: Literal["start", "reasoning", "content"] = "start"
        # Whitespace at the start of the reasoning, and of the content after it, is
        # dropped (as split_reasoning strips it) until something else comes.
        self._trim_reasoning = True
        self._trim_content = False

    def feed(self, delta: str) -> tuple[str, str]:
        return self._trimmed(*self._feed(delta))

    def _trimmed(self, reasoning: str, content: str) -> tuple[str, str]:
        if self._trim_reasoning and reasoning:
            reasoning = reasoning.lstrip()
            self._trim_reasoning = not reasoning
        if self._trim_content and content:
            content = content.lstrip()
            self._trim_content = not content
        return reasoning, content

    def _feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, content = "", ""
        if self._state == "start":
            head = self._held.lstrip()
            if self.fmt.start.startswith(head) and len(head) < len(self.fmt.start):
                return "", ""  # whitespace, or part of the opening tag: not known yet
            if head.startswith(self.fmt.start):
                self._held = head[len(self.fmt.start) :].lstrip()
                self._state = "reasoning"
            elif self.fmt.starts_inside:
                self._state = "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(self.fmt.end)
            if end < 0:
                keep = _partial_suffix(self._held, self.fmt.end)
                reasoning, self._held = self._held[:keep], self._held[keep:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held = self._held[end + len(self.fmt.end) :]
            self._state = "content"
            self._trim_content = True
        if self._state == "content":
            content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the answer."""
        return self._trimmed(*self._finish())

    def _finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "content":
            return "", held
        if self._state == "reasoning" or self.fmt.starts_inside:
            return held, ""
        return "", held  # only whitespace or a partial opening tag came


def _partial_suffix(text: str, tag: str) -> int:
    """Where a trailing piece of `text` that could begin `tag` starts (else its length)."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return i
    return len(text)
