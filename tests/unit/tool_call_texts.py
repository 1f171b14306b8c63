"""Tool calls in model text, for the tests of chat_format/tool_calls.py and the chat stream of
`auto` (test_tool_calls.py, test_tool_call_stream.py): the tools, the whole-text parse,
the plain stream, and a chat stream put together as a client does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.api.chat_tools import ToolPlan
from radixserve.chat_format.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

TOOLS = frozenset({"get_weather", "search", "calc_2"})
MARKERS = ("<tool_call>", "[TOOL_CALLS]")
Case = tuple[str, str | None, list[ToolCall]]  # text, expected content, expected calls


def args_json(args: dict[str, Any]) -> str:
    """The normalisation the module promises for arguments."""
    return json.dumps(args, ensure_ascii=False, separators=(", ", ": "))


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    return parse_tool_calls(text, TOOLS)


def stream_text(deltas: list[str]) -> tuple[list[str], list[ToolCall]]:
    """Each feed's content (then finish's) and all the calls, in order."""
    stream = ToolCallStream(TOOLS)
    shown: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content, new = stream.feed(delta)
        shown.append(content)
        calls.extend(new)
    content, new = stream.finish()
    return [*shown, content], calls + new


@dataclass
class Client:
    """A chat stream of `auto` put together as a client does: the content, and each call's
    name and argument pieces by index."""

    content: str = ""
    names: dict[int, str] = field(default_factory=dict)
    pieces: dict[int, list[str]] = field(default_factory=dict)

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments joined) of each call, in index order."""
        assert sorted(self.names) == list(range(len(self.names)))
        return [(self.names[i], "".join(self.pieces.get(i, []))) for i in sorted(self.names)]

    def normalised(self) -> list[ToolCall]:
        """The calls with their joined arguments normalised as the whole answer's are."""
        return [
            ToolCall(name, args_json(json.loads(arguments))) for name, arguments in self.calls()
        ]


def client_of(deltas: list[str], *, finish: bool = True) -> Client:
    stream = ToolPlan("auto", tuple(sorted(TOOLS)), "[]").stream()
    client = Client()
    steps = [stream.feed(d) for d in deltas]
    for content, entries in [*steps, stream.finish()] if finish else steps:
        client.content += content
        for entry in entries:
            index = entry["index"]
            if "id" in entry:
                assert index not in client.names  # announced once
                client.names[index] = entry["function"]["name"]
            if entry["function"]["arguments"]:
                client.pieces.setdefault(index, []).append(entry["function"]["arguments"])
    return client
