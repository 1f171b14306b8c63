"""Model text -> OpenAI `tool_calls`: the function calls a model writes, and the rest.

    content, calls = parse_tool_calls(text, tool_names={"get_weather"})
    # calls == [ToolCall(name="get_weather", arguments='{"city": "Paris"}')]

    stream = ToolCallStream({"get_weather"})
    for delta in deltas:
        content, calls = stream.feed(delta)  # content safe to show now, calls complete now
    content, calls = stream.finish()  # whatever was held back

Three formats are recognised, always:

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
  blocks among content; a last block left open counts when its JSON parses.
- Mistral: `[TOOL_CALLS]` then a JSON array of such objects; or the whole answer is that
  array alone (Mistral's tokenizers make `[TOOL_CALLS]` a special token, which the
  default `skip_special_tokens` leaves out of the text). Newer Mistral models write each
  call as `[TOOL_CALLS]name[ARGS]{...}` (with `[CALL_ID]id` before `[ARGS]` on some);
  with their special tokens left out, the whole answer is `name{...}`, one after another.
- Llama 3.x: the whole answer (after an optional `<|python_tag|>`) is one or more objects
  `{"name": ..., "parameters": {...}}` separated by `;` or newlines (each may follow a
  `<|python_tag|>` of its own, as Llama writes them with special tokens shown).

A call is a call only when its JSON parses, is an object with a `name` among the tools
and arguments that are an object (or a string holding one); anything else stays in the
content verbatim, markers included, so nothing the model wrote is lost. Arguments are
normalised to `json.dumps(args, ensure_ascii=False, separators=(", ", ": "))`.

The stream decides nothing it might have to take back: it emits content up to the first
possible marker, holds a trailing prefix of one, holds a `<tool_call>` block until it
closes and everything after `[TOOL_CALLS]` (or an answer opening with `{`, `[{` or
`<|python_tag|>`) until `finish()`. Whatever the split into deltas, its calls and joined
content (stripped) equal `parse_tool_calls` on the whole text. What it holds that may be
calls is `held_calls` (with the `CallLayout` of its format), for a caller that shows the
calls as they are written (`chat_format.arguments_stream`, where what is shown before it is
decided may turn out not to be a call: see there).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_MARKER = re.compile(f"{re.escape(_OPEN)}|{re.escape(_MISTRAL)}")
# A call in Mistral's named form after its `[TOOL_CALLS]`, through its arguments' `{`.
_NAMED_HEAD = r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*"
_NAMED = re.compile(_NAMED_HEAD + r"(?=\{)")
# The same with its special tokens left out: the name right before the `{`.
_BARE_NAMED_HEAD = r"([A-Za-z0-9_.\-]+)"
_BARE_NAMED = re.compile(_BARE_NAMED_HEAD + r"(?=\{)")
_NONSPACE = re.compile(r"\S")
_LLAMA_SEPARATOR = re.compile(rf"\s*[;\n]\s*(?:{re.escape(_PYTHON_TAG)}\s*)?")
_SEPARATORS = (", ", ": ")
JSON_SPACE = r"[ \t\n\r]*"  # whitespace where JSON allows it (Python's \s allows more)


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text of an object."""

    name: str
    arguments: str  # e.g. '{"city": "Paris"}'


Segment = str | ToolCall  # a piece of the answer: content text or a call


@dataclass(frozen=True)
class CallLayout:
    """Where a format's call objects lie in the text held for them, as the readers below
    take them: what comes before the first object's `{`, what between one object's `}` and
    the next one's `{` (None: one call), and the marker that ends the held text (None: it
    ends with the answer). `named`: the format writes a call as its name, then its
    arguments object (Mistral's named form): the pattern through the name (group 1) up to
    that object's `{`; None: a call is a JSON object with its name and arguments."""

    opening: re.Pattern[str]
    between: re.Pattern[str] | None = None
    closing: str | None = None
    named: re.Pattern[str] | None = None


HERMES = CallLayout(re.compile(re.escape(_OPEN) + r"\s*"), closing=_CLOSE)
MISTRAL = CallLayout(
    re.compile(re.escape(_MISTRAL) + r"\s*\[" + JSON_SPACE),
    # `,` in an array, or one array's end and the next's start (strict calls, one an array)
    re.compile(rf"{JSON_SPACE}(?:,|\]{JSON_SPACE}(?:{re.escape(_MISTRAL)}\s*)?\[){JSON_SPACE}"),
)
LLAMA = CallLayout(re.compile(rf"\s*(?:{re.escape(_PYTHON_TAG)})?\s*"), _LLAMA_SEPARATOR)
# Mistral's named calls: `[TOOL_CALLS]name[ARGS]{...}` each, or `name{...}` each with their
# special tokens left out.
MISTRAL_NAMED = CallLayout(
    re.compile(re.escape(_MISTRAL)),
    re.compile(r"\s*" + re.escape(_MISTRAL)),
    named=re.compile(_NAMED_HEAD),
)
BARE_NAMED = CallLayout(re.compile(r"\s*"), re.compile(r"\s*"), named=re.compile(_BARE_NAMED_HEAD))
# A Mistral array whose `[TOOL_CALLS]` was a special token left out of the text.
BARE_ARRAY = CallLayout(re.compile(r"\s*\[" + JSON_SPACE), MISTRAL.between)
# An answer that opens with this may be a bare array of calls; one that is only the
# start of it may still become one.
_BARE_OPENING = re.compile(r"\[" + JSON_SPACE + r"\{")
_BARE_START = re.compile(r"\[" + JSON_SPACE + r"\Z")


@dataclass(frozen=True)
class HeldCalls:
    """Text `ToolCallStream` holds back because it may be calls: how they lie in it, where
    it starts in the answer (one held text, one start), and the text so far."""

    layout: CallLayout
    start: int
    text: str


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would not round-trip


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def _loads(text: str) -> Any:
    """Strict JSON, or None when the text is not JSON."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _call(obj: Any, names: Collection[str]) -> ToolCall | None:
    """A decoded object -> its call, or None when it is not a call to one of `names`."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    elif isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name, arguments_json(args))


def arguments_json(args: Any) -> str:
    """A call's arguments as the JSON text every `ToolCall` carries (one normalisation,
    whichever format or constrained answer they came from)."""
    return json.dumps(args, ensure_ascii=False, separators=_SEPARATORS)


def _hermes(text: str, start: int, names: Collection[str]) -> tuple[Segment, int] | None:
    """The closed `<tool_call>` block at `start`: (call or its text, end), None when open."""
    end = text.find(_CLOSE, start + len(_OPEN))
    if end < 0:
        return None
    stop = end + len(_CLOSE)
    call = _call(_loads(text[start + len(_OPEN) : end].strip()), names)
    return (call or text[start:stop]), stop


def _named_call(
    text: str, pos: int, head: re.Pattern[str], names: Collection[str]
) -> tuple[ToolCall, int] | None:
    """A call in Mistral's named form at `pos` (`head`: through its name), and its end."""
    match = head.match(text, pos)
    if match is None:
        return None
    try:
        args, end = _DECODER.raw_decode(text, match.end())
    except (ValueError, RecursionError):
        return None
    call = _call({"name": match.group(1), "arguments": args}, names)
    return None if call is None else (call, end)


def _mistral(text: str, start: int, names: Collection[str]) -> tuple[list[Segment], int]:
    """`[TOOL_CALLS]` at `start` and its array or named call: (calls, end), or the marker
    as content."""
    after = start + len(_MISTRAL)
    begin = _NONSPACE.search(text, after)
    if begin is not None and text[begin.start()] != "[":
        named = _named_call(text, after, _NAMED, names)
        return ([named[0]], named[1]) if named else ([_MISTRAL], after)
    try:
        value, end = _DECODER.raw_decode(text, begin.start() if begin else after)
    except (ValueError, RecursionError):
        return [_MISTRAL], after
    calls = [_call(item, names) for item in value] if isinstance(value, list) else []
    if not calls or any(call is None for call in calls):
        return [_MISTRAL], after
    return [call for call in calls if call is not None], end


def _partial_marker(text: str, pos: int) -> int:
    """Where a trailing piece of `text` that could begin a marker starts (or its end)."""
    for i in range(max(pos, len(text) - len(_MISTRAL) + 1), len(text)):
        if _OPEN.startswith(text[i:]) or _MISTRAL.startswith(text[i:]):
            return i
    return len(text)


def _scan(text: str, names: Collection[str], *, final: bool) -> tuple[list[Segment], str]:
    """Hermes and Mistral calls among content, left to right: (segments, rest held back).

    Not `final`, it stops where more text could change the answer (an open block, a
    Mistral array, a possible marker's start) and returns that rest for later.
    """
    out: list[Segment] = []
    pos = 0
    while match := _MARKER.search(text, pos):
        if match.start() > pos:
            out.append(text[pos : match.start()])
        pos = match.start()
        if match.group() == _MISTRAL:
            if not final:
                return out, text[pos:]
            segments, pos = _mistral(text, pos, names)
            out.extend(segments)
            continue
        block = _hermes(text, pos, names)
        if block is None:
            if not final:
                return out, text[pos:]
            call = _call(_loads(text[pos + len(_OPEN) :].strip()), names)
            out.append(call or text[pos:])
            return out, ""
        segment, pos = block
        out.append(segment)
    hold = len(text) if final else _partial_marker(text, pos)
    if hold > pos:
        out.append(text[pos:hold])
    return out, text[hold:]


def _llama(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The whole answer as Llama JSON calls, or None when any of it is something else."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls: list[ToolCall] = []
    pos = 0
    while body.startswith("{", pos):
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        call = _call(obj, names)
        if call is None:
            return None
        calls.append(call)
        if pos == len(body):
            return calls
        separator = _LLAMA_SEPARATOR.match(body, pos)
        if separator is None:
            return None
        pos = separator.end()
    return None


def _bare_array(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The whole answer as Mistral arrays of calls without their markers (one or more,
    as strict calls write one an array), or None when any of it is something else."""
    body = text.strip()
    if not _BARE_OPENING.match(body):
        return None
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        if not body.startswith("[", pos):
            return None
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        found = [_call(item, names) for item in value] if isinstance(value, list) else []
        if not found or any(call is None for call in found):
            return None
        calls += [call for call in found if call is not None]
        gap = _NONSPACE.search(body, pos)
        pos = gap.start() if gap else len(body)
    return calls


def _bare_named(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The whole answer as Mistral's named calls without their special tokens
    (`name{...}`, one after another), or None when any of it is something else."""
    body = text.strip()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body) or not calls:
        named = _named_call(body, pos, _BARE_NAMED, names)
        if named is None:
            return None
        calls.append(named[0])
        gap = _NONSPACE.search(body, named[1])
        pos = gap.start() if gap else len(body)
    return calls


def _split(segments: list[Segment]) -> tuple[str, list[ToolCall]]:
    content = "".join(s for s in segments if isinstance(s, str))
    return content, [s for s in segments if isinstance(s, ToolCall)]


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's `tool_calls` entry (with `index` in a streamed delta), a fresh id."""
    body: dict[str, Any] = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return body if index is None else {"index": index, **body}


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """A finished answer -> (content, calls): the text outside the calls, stripped (None
    when nothing is left), and the calls in the order written."""
    calls = _llama(text, tool_names)
    if calls is None:
        calls = _bare_array(text, tool_names)
    if calls is None:
        calls = _bare_named(text, tool_names)
    if calls is not None:
        return None, calls
    content, calls = _split(_scan(text, tool_names, final=True)[0])
    return content.strip() or None, calls


class ToolCallStream:
    """`parse_tool_calls` fed the answer's text in pieces as they are generated."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self._names = frozenset(tool_names)
        self._held = ""  # text not yet emitted
        # start: nothing but whitespace (or a `<|python_tag|>` or `[` prefix) seen yet;
        # whole: the answer opens like Llama JSON or a bare array, decided at finish();
        # scan: otherwise.
        self._mode: Literal["start", "whole", "scan"] = "start"
        self._shown = False  # some content was emitted: whitespace is no longer leading
        self._fed = 0  # characters of the answer fed so far

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content safe to show now (never part of a call), and the calls completed now."""
        self._held += delta
        self._fed += len(delta)
        if self._mode == "start":
            self._mode = _opening(self._held, self._names)
        if self._mode != "scan":
            return "", []
        segments, self._held = _scan(self._held, self._names, final=False)
        return self._emit(segments)

    @property
    def held_calls(self) -> HeldCalls | None:
        """What the stream holds back because it may be calls (a `<tool_call>` block not
        closed yet, a `[TOOL_CALLS]` array, an answer that opens like Llama's or like a
        bare array), for a caller that shows them as they are written; None when it holds
        none."""
        head = self._held.lstrip()
        if self._mode == "whole" and head.startswith("["):
            layout = BARE_ARRAY
        elif self._mode == "whole" and head.startswith(("{", _PYTHON_TAG)):
            layout = LLAMA
        elif self._mode == "whole":
            layout = BARE_NAMED
        elif self._mode == "scan" and self._held.startswith(_OPEN):
            layout = HERMES
        elif self._mode == "scan" and self._held.startswith(_MISTRAL):
            after = self._held[len(_MISTRAL) :].lstrip()
            if not after:
                return None  # an array or a named call: not known yet
            layout = MISTRAL if after.startswith("[") else MISTRAL_NAMED
        else:
            return None
        return HeldCalls(layout, self._fed - len(self._held), self._held)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the answer: whatever was held back, as content or calls."""
        text, self._held = self._held, ""
        if self._mode == "scan":
            return self._emit(_scan(text, self._names, final=True)[0])
        content, calls = parse_tool_calls(text, self._names)
        return self._emit([content or "", *calls])

    def _emit(self, segments: list[Segment]) -> tuple[str, list[ToolCall]]:
        content, calls = _split(segments)
        if not self._shown:
            content = content.lstrip()
            self._shown = bool(content)
        return content, calls


def _opening(text: str, names: Collection[str]) -> Literal["start", "whole", "scan"]:
    """How an answer that begins with `text` must be streamed, if that is known yet."""
    head = text.lstrip()
    if head.startswith(("{", _PYTHON_TAG)) or _BARE_OPENING.match(head):
        return "whole"
    if (named := _BARE_NAMED.match(head)) and named.group(1) in names:
        return "whole"  # `name{`: Mistral's named call, its special tokens left out
    if not head or _PYTHON_TAG.startswith(head) or _BARE_START.match(head):
        return "start"
    if any(f"{name}{{".startswith(head) for name in names):
        return "start"
    return "scan"
