"""A reasoning model's answer split into its reasoning and its content (`<think>` ... `</think>`).

    fmt = REASONING_FORMATS["qwen3"]                  # the gateway's --reasoning-parser
    reasoning, content = split_reasoning(text, fmt)   # a finished answer
    stream = ReasoningStream(fmt)
    reasoning_delta, content_delta = stream.feed(delta)   # a piece at a time, then finish()
    counter = ReasoningTokens(fmt)                    # usage's reasoning_tokens:
    counter.feed(delta, delta_tokens, last=False)     # each delta's text; then .count

OpenAI-compatible servers answer it as `message.reasoning_content` (streamed as
`delta.reasoning_content`) beside `content`, as SGLang's and vLLM's reasoning parsers do:
- `qwen3`: the model opens its reasoning itself: an answer that starts with `<think>` is
  reasoning up to `</think>`, any other is content only (thinking switched off);
- `deepseek-r1`: the chat template opens `<think>` in the prompt: the answer is
  reasoning up to `</think>` (all of it when the tag never comes), a `<think>` the
  model repeats at its start dropped.
An answer cut short inside its reasoning is reasoning only.

`usage.completion_tokens_details.reasoning_tokens` (OpenAI's o-series, vLLM, SGLang)
counts the tokens up to and including the one that closes the reasoning, by the same
rules (`ReasoningTokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["start", "reasoning", "content"]


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
        self._state: Phase = "start"
        self._reasoned = False  # the reasoning was opened (it may have closed since)
        # Whitespace at the start of the reasoning, and of the content after it, is
        # dropped (as split_reasoning strips it) until something else comes.
        self._trim_reasoning = True
        self._trim_content = False

    def feed(self, delta: str) -> tuple[str, str]:
        return self._trimmed(*self._feed(delta))

    @property
    def phase(self) -> Phase:
        """Where the answer stands after what was fed: "start" while it is not known
        whether it opens with reasoning (only whitespace or part of the opening tag came),
        then "reasoning" until the closing tag, then "content". Never "start" after
        `finish`."""
        return self._state

    @property
    def reasoned(self) -> bool:
        """Whether the answer opened its reasoning (it may have closed it since)."""
        return self._reasoned

    def _enter(self, state: Phase) -> None:
        self._state = state
        self._reasoned = self._reasoned or state == "reasoning"

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
                self._enter("reasoning")
            else:
                self._enter("reasoning" if self.fmt.starts_inside else "content")
        if self._state == "reasoning":
            end = self._held.find(self.fmt.end)
            if end < 0:
                keep = _partial_suffix(self._held, self.fmt.end)
                reasoning, self._held = self._held[:keep], self._held[keep:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held = self._held[end + len(self.fmt.end) :]
            self._enter("content")
            self._trim_content = True
        if self._state == "content":
            content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the answer."""
        return self._trimmed(*self._finish())

    def _finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "start":  # only whitespace or a partial opening tag came
            self._enter("reasoning" if self.fmt.starts_inside else "content")
        return (held, "") if self._state == "reasoning" else ("", held)


class ReasoningTokens:
    """How many of an answer's tokens are reasoning, fed its deltas as they come (each
    delta's text and how many tokens it carries): the tokens up to and including the one
    that closes the reasoning; all of them when it never closes (an answer cut short
    inside its reasoning); none when the answer has no reasoning (`qwen3` not opening
    with `<think>`). The text goes through a `ReasoningStream`, so the rules are its.

    Each delta counts whole, by where the stream stands after it: reasoning while the
    reasoning is open, including the delta in which it closes. So a delta carrying
    tokens from both sides of the closing tag counts them all as reasoning (the
    detokenizer merges tokens into one delta when it holds text back: a split
    character, or what could begin a stop string). With `</think>` a single token, as in
    Qwen3 and DeepSeek-R1, the count is exact: the tag's text is whole, so it comes in
    its own token's delta, never with the content after it (unless a stop string that
    could begin with it held it back). Tokens that come before the answer's opening is
    known (whitespace, part of `<think>`) count with what it turns out to be.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._stream = ReasoningStream(fmt)
        self.count = 0
        self._undecided = 0  # tokens fed while the stream's phase was "start"
        self._settled = False  # the reasoning closed, or there was none: nothing more counts

    def feed(self, text: str, tokens: int, last: bool = False) -> None:
        """One delta: its text and number of tokens; `last` for the answer's last delta."""
        if self._settled:
            return
        self._stream.feed(text)
        if last:
            self._stream.finish()
        self._undecided += tokens
        if self._stream.phase == "start":
            return
        if self._stream.reasoned:
            self.count += self._undecided
        self._undecided = 0
        self._settled = self._stream.phase == "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Where a trailing piece of `text` that could begin `tag` starts (else its length)."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return i
    return len(text)
