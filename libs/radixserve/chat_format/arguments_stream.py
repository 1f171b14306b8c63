"""Tool calls' arguments shown while the model writes them, in each format `tool_calls` reads.

    followed = FollowedCalls(held.layout, names)  # held: ToolCallStream.held_calls
    for piece in followed.pieces(held.text, next_index):  # as the held text grows
        ...  # piece.name set: a call announced (its index); else a piece of its arguments
    sent = followed.sent(calls)  # how many of the calls read whole were sent already

`chat_format.tool_calls.ToolCallStream` holds back text that may be calls until it is decided: a
Hermes `<tool_call>` block until it closes, a Mistral `[TOOL_CALLS]` array, a Llama
answer (one that opens with `{` or `<|python_tag|>`), a bare array (one that opens with
`[{`) and Mistral's named calls (`[TOOL_CALLS]name[ARGS]{...}`, or `name{...}` without
their special tokens) until the answer ends. An agent's call can carry a long argument
(a file's contents), so the chat stream shows each call as it comes, as OpenAI streams
`function.arguments`: once a call object reads `{"name": "<one of the tools>",
"arguments": {` (or `"parameters": {`, which the reader takes in every format; a named
call: once its name reaches its arguments' `{`, the layout's `named` pattern), an entry
with the call's id and name, then the arguments object's text piece by piece, up to the
brace that closes it (found by a scan that knows JSON strings, each character read once).
The held text's `CallLayout` says where the first call object begins and what separates
one from the next (`,` in a Mistral array, `;` or a newline between Llama objects,
`[TOOL_CALLS]` between named calls), so the calls of one array or answer are announced
one after another, each once the one before it has closed.

The pieces joined are the arguments as the model wrote them; the whole call, read when the
held text is decided, says the same in normalised form (and is not sent again). A call
written otherwise (arguments before the name, as a string, missing, or a call object that
never reads like that) is left to arrive whole, and so are the calls after it in the same
held text, so that the calls keep the order they were written in.

An announced call cannot be taken back. One that turns out not to be a call when its text
is decided (a Hermes block malformed when it closes; a Mistral array with a bad item, or
cut short; a Llama answer with anything but calls in it, or cut short) keeps its entry, and
its text also comes back as content, as the whole answer reads it; one whose whole reading
differs from what was sent (a key written twice: JSON keeps the last) is sent again whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from radixserve.chat_format.tool_calls import JSON_SPACE, CallLayout, ToolCall, arguments_json

_S = JSON_SPACE
_HEAD = re.compile(
    rf'\{{{_S}"name"{_S}:{_S}"([^"\\]*)"{_S},{_S}"(?:arguments|parameters)"{_S}:{_S}'
)
# Past this much text without the next call's head, the rest is left to arrive whole.
_HEAD_WINDOW = 256
# What may still become a named call's `[ARGS]` or `[CALL_ID]` (the `{` still to come).
_NAMED_MARKS = ("[ARGS]", "[CALL_ID]")


@dataclass(frozen=True)
class ArgumentsPiece:
    """What the held text adds to one call: its announcement (`name` set, the call takes
    `index`; `arguments` empty), or the next piece of its arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass
class _Brackets:
    """JSON text's bracket depth from `pos` on, as the text grows (each character read once)."""

    pos: int
    depth: int = 0
    in_string: bool = False
    escape: bool = False

    def close(self, text: str, depth: int) -> int | None:
        """Just past the bracket that brings the depth back down to `depth`; None when
        `text` does not have it yet."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == depth:
                    self.pos = i + 1
                    return i + 1
        self.pos = max(self.pos, len(text))
        return None


@dataclass
class _Call:
    """An announced call whose object is being read."""

    index: int
    name: str
    arguments_start: int  # where in the held text its arguments begin
    brackets: _Brackets  # from the call object's `{` (a named call's: its arguments')
    sent: int  # where the arguments not sent yet begin
    named: bool = False  # the call object is its arguments (Mistral's named form)
    complete: bool = False  # its arguments object closed: all of it was sent
    end: int = 0  # where its arguments object ends, once complete


class FollowedCalls:
    """The calls of one held text (`tool_calls.HeldCalls`), followed as it grows."""

    def __init__(self, layout: CallLayout, names: Collection[str]) -> None:
        self._layout = layout
        self._names = names
        self._gap: re.Pattern[str] | None = layout.opening  # before the next call object
        self._next = 0  # where that gap starts in the held text
        self._call: _Call | None = None  # the call being read
        self._seen = 0  # how much of the held text was seen (for its closing marker)
        self._complete: list[tuple[str, str]] = []  # (name, arguments) sent in full, as written
        self._done = False  # nothing more to follow: the rest arrives whole

    def pieces(self, text: str, next_index: int) -> list[ArgumentsPiece]:
        """What the held text so far adds: calls announced (from index `next_index` on)
        and pieces of their arguments, in order."""
        text = self._upto_closing(text)
        out: list[ArgumentsPiece] = []
        while not self._done:
            call = self._call
            if call is None:
                call = self._call = self._announce(text, next_index)
                if call is None:
                    break
                out.append(ArgumentsPiece(call.index, call.name, ""))
                next_index += 1
            if not call.complete:
                # The arguments object's own brace (a named call's object is its arguments).
                end = call.brackets.close(text, 0 if call.named else 1)
                upto = len(text) if end is None else end
                if upto > call.sent:
                    out.append(ArgumentsPiece(call.index, None, text[call.sent : upto]))
                    call.sent = upto
                if end is None:
                    break
                call.complete, call.end = True, end
                self._complete.append((call.name, text[call.arguments_start : end]))
            end = call.end if call.named else call.brackets.close(text, 0)  # the call object's
            if end is None:
                break
            self._call, self._next, self._gap = None, end, self._layout.between
            self._done = self._gap is None
        return out

    def sent(self, calls: list[ToolCall]) -> int:
        """How many of `calls` (read whole once the held text was decided) lead with calls
        sent here in full: the same names and, normalised, the same arguments."""
        count = 0
        for (name, streamed), read in zip(self._complete, calls, strict=False):
            if name != read.name:
                break
            try:
                arguments = arguments_json(json.loads(streamed))
            except (ValueError, RecursionError):
                break
            if arguments != read.arguments:
                break
            count += 1
        return count

    def _upto_closing(self, text: str) -> str:
        """The held text up to the layout's closing marker (a Hermes block's end), which
        is there once the block closed."""
        closing = self._layout.closing
        if closing is not None:
            end = text.find(closing, max(0, self._seen - len(closing) + 1))
            if end >= 0:
                text = text[:end]
        self._seen = len(text)
        return text

    def _announce(self, text: str, index: int) -> _Call | None:
        """The next call, once its object reads `{"name": <a tool>, "arguments": {` (a
        named call: once its name, and what its layout puts between, reach the `{`)."""
        assert self._gap is not None
        gap = self._gap.match(text, self._next)
        named = self._layout.named
        head = (named or _HEAD).match(text, gap.end()) if gap else None
        if gap is None or head is None:
            self._done = len(text) - self._next > _HEAD_WINDOW
            return None
        start = head.end()
        if start == len(text):
            return None  # the arguments' first character is still to come
        if named is not None and text[start] != "{":
            rest = text[start:]
            if any(mark.startswith(rest) for mark in _NAMED_MARKS):
                return None  # `[ARGS]` (or `[CALL_ID]`) still being written
        if head.group(1) not in self._names or text[start] != "{":
            self._done = True
            return None
        if named is not None:
            return _Call(index, head.group(1), start, _Brackets(start), sent=start, named=True)
        return _Call(index, head.group(1), start, _Brackets(gap.end()), sent=start)
