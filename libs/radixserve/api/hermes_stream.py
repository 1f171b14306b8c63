"""A Hermes `<tool_call>` block's arguments shown while the model writes them.

    follow = OpenCall(names)
    announced, piece = follow.pieces(block_text, next_index)   # as the held block grows

`api.tool_calls.ToolCallStream` holds a `<tool_call>` block back until it closes, then
gives the whole call. An agent's call can carry a long argument (a file's contents), so
the chat stream shows it as it comes, as OpenAI streams `function.arguments`: once the
block reads `<tool_call>{"name": "<one of the tools>", "arguments": {`, an entry with the
call's id and name, then the arguments object's text piece by piece, up to the brace
that closes it (found by a scan that knows JSON strings, each character read once).
The pieces joined are the arguments as the model wrote them; the whole call, read when
the block closes, says the same in normalised form (and is not sent again). Anything
else (arguments before the name, as a string, a block that never reads like that)
is left to arrive whole.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

from radixserve.api.tool_calls import ToolCall

_HEAD = re.compile(
    r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
# Past this much text without the head matching, the block is left to arrive whole.
_HEAD_WINDOW = 256


@dataclass
class _ObjectEnd:
    """Where a JSON object closes, scanning its text as it grows (each character once)."""

    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escape: bool = False

    def find(self, text: str) -> int | None:
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
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


@dataclass
class OpenCall:
    """The call of one open `<tool_call>` block, followed as the block grows."""

    names: Collection[str]
    index: int | None = None  # its `tool_calls` index once announced
    name: str = ""
    arguments: str = ""  # the arguments text sent so far
    complete: bool = False  # the arguments object closed: all of it was sent
    given_up: bool = False  # not a block this follows: it arrives whole
    _start: int = 0  # where the arguments start in the block's text
    _end: _ObjectEnd = field(default_factory=_ObjectEnd)

    def pieces(self, block: str, next_index: int) -> tuple[bool, str]:
        """What the block's text so far adds: whether the call is announced now (taking
        `next_index`), and the next piece of its arguments ("" when none)."""
        if self.given_up or self.complete:
            return False, ""
        announced = False
        if self.index is None:
            head = _HEAD.match(block)
            if head is None:
                self.given_up = len(block) > _HEAD_WINDOW
                return False, ""
            rest = block[head.end() :]
            if not rest:
                return False, ""
            if head.group(1) not in self.names or not rest.startswith("{"):
                self.given_up = True
                return False, ""
            self.index, self.name, self._start = next_index, head.group(1), head.end()
            announced = True
        text = block[self._start :]
        end = self._end.find(text)
        upto = len(text) if end is None else end
        piece = text[len(self.arguments) : upto]
        self.complete = end is not None
        self.arguments += piece
        return announced, piece

    def is_the_call(self, call: ToolCall, normalised: str) -> bool:
        """Whether `call` (read whole when the block closed) is the one followed here,
        `normalised` being this one's arguments in the reader's normal form."""
        return self.complete and call.name == self.name and call.arguments == normalised
