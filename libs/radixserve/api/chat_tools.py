"""Chat requests with `tools`: what the model is asked for, and its answer read back.

    tools = plan_tools(req)            # ApiError (400) for tools or a tool_choice that cannot run
    submit = SubmitRequest(..., tools=tools.tools_json, sampling=... json_schema=tools.schema)
    content, calls = tools.read(text)  # a finished choice -> message content, OpenAI tool_calls
    stream = tools.stream()            # content and `delta.tool_calls` entries, a delta at a time

`tool_choice` (OpenAI's; default "auto" when there are tools):
- "auto": the model sees the tools (`SubmitRequest.tools`, rendered by the chat
  template) and may answer in text or call them in its own format, which
  `chat_format.tool_calls` recognises (Hermes / Qwen `<tool_call>`, Mistral `[TOOL_CALLS]`
  arrays and named calls, with their markers or without, Llama 3 JSON);
- "required": the answer is constrained (a JSON schema, the grammar hop) to a JSON array
  of `{"name", "arguments"}` calls of the given tools (one with `parallel_tool_calls`
  false);
- a named function: the answer is constrained to that function's arguments object;
- "none": plain chat, the tools not shown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.api.errors import ApiError
from radixserve.api.openai_models import ChatCompletionRequest, NamedToolChoice, ToolDef
from radixserve.chat_format.arguments_stream import FollowedCalls
from radixserve.chat_format.tool_calls import (
    HeldCalls,
    ToolCall,
    ToolCallStream,
    arguments_json,
    parse_tool_calls,
    tool_call_body,
)

ToolMode = Literal["auto", "required", "named"]
# OpenAI's rule for a function name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat request, and how its answer is read."""

    mode: ToolMode
    names: tuple[str, ...]
    tools_json: str  # SubmitRequest.tools: OpenAI's list, for the chat template
    schema: str | None = None  # the answer's JSON schema ("required" and named)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's text -> (message content, calls)."""
        if self.mode == "auto":
            return parse_tool_calls(text, self.names)
        return _read_forced(self, text)

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice as content and OpenAI `delta.tool_calls` entries. `auto`:
    content as soon as it is known not to be a call; a call's arguments piece by piece as
    the model writes them, in any of the formats (`chat_format.arguments_stream`), or the call in
    one entry once it is decided where it is written otherwise. Named: the answer is the
    call's arguments, streamed as they come (the first entry carries the id and name).
    Required: a list of calls, read at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._auto = ToolCallStream(plan.names) if plan.mode == "auto" else None
        # auto: the calls of the text `_auto` holds back, followed as the model writes
        # them, and where that text starts in the answer (one start, one held text)
        self._followed: FollowedCalls | None = None
        self._followed_at = -1
        self._held: list[str] = []
        self.calls = 0  # entries that opened a call so far

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self._auto is not None:
            before = self._auto.held_calls
            content, calls = self._auto.feed(delta)
            return content, self._auto_entries(before, delta, calls, self._auto.held_calls)
        if self.plan.mode == "named":
            return "", self._arguments(delta)
        self._held.append(delta)
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._auto is not None:
            before = self._auto.held_calls
            content, calls = self._auto.finish()
            return content, self._auto_entries(before, "", calls, None)
        if self.plan.mode == "named":
            # An empty answer is still the call (with empty arguments), as read whole.
            return "", [] if self.calls else self._arguments("", opening=True)
        text, calls = _read_forced(self.plan, "".join(self._held))
        return text or "", self._entries(calls)

    def _auto_entries(
        self,
        before: HeldCalls | None,
        delta: str,
        calls: list[ToolCall],
        after: HeldCalls | None,
    ) -> list[dict[str, Any]]:
        """The entries of one step in `auto` (`delta` fed, or the end): `calls` decided in
        it, whole, and those of the held text (`before` the step, `after` it) followed as
        the model writes them."""
        entries: list[dict[str, Any]] = []
        if self._followed is not None:
            if after is not None and after.start == self._followed_at:  # still held
                return self._entries(calls) + self._follow(after.text)
            # Decided in this step: the pieces its end adds, then the calls read whole less
            # those sent piece by piece.
            assert before is not None and before.start == self._followed_at
            entries += self._follow(before.text + delta)
            calls = calls[self._followed.sent(calls) :]
            self._followed = None
        entries += self._entries(calls)
        if after is not None:
            self._followed = FollowedCalls(after.layout, self.plan.names)
            self._followed_at = after.start
            entries += self._follow(after.text)
        return entries

    def _follow(self, text: str) -> list[dict[str, Any]]:
        """The followed calls' announcements and argument pieces that `text` adds."""
        assert self._followed is not None
        entries = []
        for piece in self._followed.pieces(text, self.calls):
            if piece.name is not None:
                entries += self._entries([ToolCall(piece.name, "")])
            else:
                entries.append({"index": piece.index, "function": {"arguments": piece.arguments}})
        return entries

    def _entries(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        entries = [tool_call_body(call, self.calls + i) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return entries

    def _arguments(self, text: str, opening: bool = False) -> list[dict[str, Any]]:
        if not text and not opening:
            return []
        if self.calls == 0:
            return self._entries([ToolCall(self.plan.names[0], text)])
        return [{"index": 0, "function": {"arguments": text}}]


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, checked; None when the model is not to call any."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise ApiError.invalid(
                f"{legacy} is OpenAI's deprecated form of {current}: send {current}", legacy
            )
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError.invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = _check_tools(req.tools)
    tools_json = json.dumps([t.model_dump(exclude_none=True) for t in req.tools])
    if choice is None or choice == "auto":
        return ToolPlan("auto", names, tools_json)
    _check_no_other_grammar(req)
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in req.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise ApiError.invalid(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                "tool_choice",
            )
        schema = tool.function.parameters or _ANY_OBJECT
        return ToolPlan("named", (tool.function.name,), tools_json, json.dumps(schema))
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(t) for t in req.tools]},
    }
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolPlan("required", names, tools_json, json.dumps(calls))


def _check_tools(tools: list[ToolDef]) -> tuple[str, ...]:
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise ApiError.invalid(
                f"a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}",
                f"tools[{i}].function.name",
            )
        if name in names:
            raise ApiError.invalid(f"two tools are named {name!r}", f"tools[{i}].function.name")
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError.invalid(
                "a function's parameters are a JSON schema of an object",
                f"tools[{i}].function.parameters",
            )
        names.append(name)
    return tuple(names)


def _check_no_other_grammar(req: ChatCompletionRequest) -> None:
    """A forced call is a grammar of its own: a second one cannot apply too."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        raise ApiError.invalid(
            "response_format cannot be combined with a required or named tool_choice",
            "response_format",
        )
    for field in ("regex", "json_schema", "ebnf", "structural_tag"):
        if getattr(req, field) is not None:
            raise ApiError.invalid(
                f"{field} cannot be combined with a required or named tool_choice", field
            )


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "arguments": tool.function.parameters or _ANY_OBJECT,
        },
        "required": ["name", "arguments"],
    }


def _read_forced(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A constrained answer -> its calls. One cut short (max_tokens) does not parse: a
    named call keeps the partial arguments (OpenAI does too, with finish_reason length);
    a required list is returned as content."""
    try:
        value = json.loads(text)
    except ValueError:
        if plan.mode == "named":
            return None, [ToolCall(plan.names[0], text)]
        return text or None, []
    if plan.mode == "named":
        return None, [ToolCall(plan.names[0], arguments_json(value))]
    items = value if isinstance(value, list) else []
    calls = [
        ToolCall(item["name"], arguments_json(item.get("arguments", {})))
        for item in items
        if isinstance(item, dict) and item.get("name") in plan.names
    ]
    return (None, calls) if calls else (text or None, [])
