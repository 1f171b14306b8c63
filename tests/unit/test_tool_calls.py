"""Tool calls in model text: the Hermes/Qwen, Mistral and Llama formats, what stays content
(broken JSON, unknown names, prose with braces), and the stream, which whatever the split
into deltas must agree with the whole-text parse and show plain content early. The chat
stream of `auto` (`chat_tools.ToolStream`, calls followed by `arguments_stream`) must give
a client the same calls, their arguments piece by piece as the model writes them."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api.chat_tools import ToolPlan
from radixserve.api.tool_calls import (
    HERMES,
    LLAMA,
    MISTRAL,
    HeldCalls,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
)

TOOLS = frozenset({"get_weather", "search", "calc_2"})
MARKERS = ("<tool_call>", "[TOOL_CALLS]")
Case = tuple[str, str | None, list[ToolCall]]  # text, expected content, expected calls


def _args(args: dict[str, Any]) -> str:
    """The normalisation the module promises for arguments."""
    return json.dumps(args, ensure_ascii=False, separators=(", ", ": "))


def _parse(text: str) -> tuple[str | None, list[ToolCall]]:
    return parse_tool_calls(text, TOOLS)


def _stream(deltas: list[str]) -> tuple[list[str], list[ToolCall]]:
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
class _Client:
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
        return [ToolCall(name, _args(json.loads(arguments))) for name, arguments in self.calls()]


def _client(deltas: list[str], *, finish: bool = True) -> _Client:
    stream = ToolPlan("auto", tuple(sorted(TOOLS)), "[]").stream()
    client = _Client()
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


# -- Hermes / Qwen -------------------------------------------------------------------------


def test_hermes_one_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_hermes_calls_among_content() -> None:
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "and\n"
        '<tool_call>  {"name":"search","arguments":{"q":"café","n":2}}  </tool_call>'
        " Done."
    )
    assert _parse(text) == (
        "Let me check.\n\nand\n Done.",
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("search", '{"q": "café", "n": 2}')],
    )


def test_hermes_unterminated_last_block() -> None:
    text = (
        '<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n'
        '<tool_call>\n{"name": "calc_2", "arguments": {"x": [1, 2]}}\n'
    )
    assert _parse(text) == (
        None,
        [ToolCall("search", '{"q": "a"}'), ToolCall("calc_2", '{"x": [1, 2]}')],
    )


def test_hermes_unterminated_broken_block_is_content() -> None:
    text = 'Sure <tool_call>{"name": "search", "arguments": {"q":'
    assert _parse(text) == (text, [])


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}', '{"q": "x"}'),
        ('{"name": "search", "parameters": {"q": "x"}}', '{"q": "x"}'),
        ('{"name": "search", "parameters": "{\\"q\\":\\"x\\"}"}', '{"q": "x"}'),
        ('{"name": "search"}', "{}"),
        ('{"name": "search", "arguments": null}', "{}"),
        (
            '{"name": "search", "arguments": {"a": {"b": [true, null]}}}',
            '{"a": {"b": [true, null]}}',
        ),
        ('{"name": "search", "arguments": {"s": "日本 \\u00e9"}}', '{"s": "日本 é"}'),
    ],
)
def test_arguments_forms(body: str, arguments: str) -> None:
    assert _parse(f"<tool_call>{body}</tool_call>") == (None, [ToolCall("search", arguments)])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "search", "arguments": {"q": </tool_call>',  # broken JSON
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # unknown name
        '<tool_call>{"arguments": {"q": "x"}}</tool_call>',  # no name
        '<tool_call>[{"name": "search"}]</tool_call>',  # not an object
        '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',  # arguments a list
        '<tool_call>{"name": "search", "arguments": "[1]"}</tool_call>',  # string, not an object
        '<tool_call>{"name": "search", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        "<tool_call></tool_call>",
    ],
)
def test_invalid_hermes_block_stays_content_verbatim(block: str) -> None:
    text = f"Before {block} after"
    assert _parse(text) == (text, [])
    good = '<tool_call>{"name": "search"}</tool_call>'
    assert _parse(f"{block}\n{good}") == (block, [ToolCall("search", "{}")])


# -- Mistral -------------------------------------------------------------------------------


def test_mistral_one_call() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert _parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_mistral_several_calls_with_ids_and_content_before() -> None:
    text = (
        "I will look both up.\n[TOOL_CALLS]"
        '[{"name": "search", "arguments": {"q": "a"}, "id": "abc123DEF"},'
        ' {"name": "calc_2", "arguments": "{\\"x\\": 1}", "id": "xyz987abc"},'
        ' {"name": "search"}]'
    )
    assert _parse(text) == (
        "I will look both up.",
        [
            ToolCall("search", '{"q": "a"}'),
            ToolCall("calc_2", '{"x": 1}'),
            ToolCall("search", "{}"),
        ],
    )


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS] [{"name": "search", "arguments": {"q":',  # cut off
        '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',  # unknown name
        '[TOOL_CALLS] [{"name": "search"}, {"name": "nope"}]',  # one bad: all content
        '[TOOL_CALLS] {"name": "search"}',  # not an array
        "[TOOL_CALLS] []",
        "Hi [TOOL_CALLS]",
    ],
)
def test_invalid_mistral_stays_content_verbatim(text: str) -> None:
    assert _parse(text) == (text, [])


# -- Llama 3.x -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '  \n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|> {"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}',
    ],
)
def test_llama_one_call(text: str) -> None:
    assert _parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("separator", [";", "; ", "\n", " ;\n", "\n\n"])
def test_llama_several_calls(separator: str) -> None:
    text = separator.join(['{"name": "search", "parameters": {"q": "a;b"}}', '{"name": "calc_2"}'])
    assert _parse(text) == (None, [ToolCall("search", '{"q": "a;b"}'), ToolCall("calc_2", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "search", "parameters": {}} and some words',  # not the whole answer
        'Here: {"name": "search", "parameters": {}}',
        '{"name": "search"} {"name": "calc_2"}',  # no separator
        '{"name": "search"};',  # nothing after the separator
        '{"name": "search"}; {"name": "nope"}',  # unknown name
        '{"city": "Paris"}',  # a JSON object that is not a call
        '<|python_tag|>print("hi")',
        '{"name": "search", "parameters": {',
    ],
)
def test_not_llama_stays_content(text: str) -> None:
    assert _parse(text) == (text.strip(), [])


# -- plain content -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Use a dict like {'a': 1} or a set {1, 2}.",
        'In JSON: {"name": "search", "parameters": {}} is how it looks.',
        "if (x < y) { return [a, b]; } // <tool_ or [TOOL_",
        "a </tool_call> b",
        "<|python_tag",
        "",
        "   \n ",
    ],
)
def test_prose_stays_content(text: str) -> None:
    assert _parse(text) == (text.strip() or None, [])


# -- streaming, by hand --------------------------------------------------------------------


def test_stream_shows_plain_content_at_once() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hello, I will check") == ("Hello, I will check", [])
    assert stream.feed(" the weather <tool") == (" the weather ", [])
    assert stream.feed("s> are fine [TOOL") == ("<tools> are fine ", [])
    assert stream.feed("S] x") == ("[TOOLS] x", [])
    assert stream.finish() == ("", [])


def test_stream_holds_a_block_until_it_closes() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hi <tool_call>") == ("Hi ", [])
    assert stream.feed('{"name": "search", "arguments": {"q": "x"}}') == ("", [])
    assert stream.feed("</tool_call> bye") == (" bye", [ToolCall("search", '{"q": "x"}')])
    assert stream.feed('<tool_call>{"name": "nope"}</tool_call>') == (
        '<tool_call>{"name": "nope"}</tool_call>',
        [],
    )
    assert stream.finish() == ("", [])


def test_stream_holds_mistral_and_llama_until_finish() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed('Ok [TOOL_CALLS] [{"name": "search"}]') == ("Ok ", [])
    assert stream.finish() == ("", [ToolCall("search", "{}")])
    for opening in ('  {"name": "search"}', '<|python_tag|>{"name": "search"}'):
        stream = ToolCallStream(TOOLS)
        assert stream.feed(opening) == ("", [])
        assert stream.finish() == ("", [ToolCall("search", "{}")])
    stream = ToolCallStream(TOOLS)
    assert stream.feed("{not a call} ok") == ("", [])
    assert stream.finish() == ("{not a call} ok", [])


def test_stream_holds_leading_whitespace() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("\n  ") == ("", [])
    assert stream.feed(" <|py") == ("", [])
    assert stream.feed("thon") == ("", [])
    assert stream.feed(" says hi") == ("<|python says hi", [])
    only_calls = ["\n ", '<tool_call>{"name": "search"}</tool_call>', "\n"]
    assert _stream(only_calls) == (["", "", "", ""], [ToolCall("search", "{}")])


def test_stream_character_by_character() -> None:
    text = (
        'Checking {braces} <b>now</b>. <tool_call>{"name": "search", "arguments": "{}"}'
        '</tool_call> then [TOOL_CALLS][{"name": "calc_2", "arguments": {"x": 1}}]'
    )
    shown, calls = _stream(list(text))
    assert "".join(shown) == "Checking {braces} <b>now</b>.  then "
    assert calls == [ToolCall("search", "{}"), ToolCall("calc_2", '{"x": 1}')]


def test_held_calls_say_what_is_held_and_where() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hi <tool_call>{") == ("Hi ", [])
    assert stream.held_calls == HeldCalls(HERMES, 3, "<tool_call>{")
    text = 'Hi <tool_call>{"name": "search"}</tool_call> ok [TOOL_CALLS] ['
    stream.feed(text.removeprefix("Hi <tool_call>{"))
    assert stream.held_calls == HeldCalls(MISTRAL, text.index("[TOOL"), "[TOOL_CALLS] [")
    stream = ToolCallStream(TOOLS)
    assert stream.feed(" \n") == ("", []) and stream.held_calls is None
    stream.feed('<|python_tag|>{"na')
    assert stream.held_calls == HeldCalls(LLAMA, 0, ' \n<|python_tag|>{"na')
    stream = ToolCallStream(TOOLS)
    stream.feed("Plain <tool")
    assert stream.held_calls is None  # a marker's prefix, not a call yet


# -- arguments as the model writes them (the chat stream of auto) --------------------------

_FILE = "def f(x):\n    return {'a': [x, \"}\"]}  # ;\n" * 12  # an agent writing a file
_LONG = {"q": _FILE, "n": 2}


def _obj(name: str, args: dict[str, Any], key: str = "arguments", **extra: str) -> str:
    return json.dumps({"name": name, key: args, **extra})


@pytest.mark.parametrize(
    "text",
    [
        f"Writing it.\n<tool_call>\n{_obj('search', _LONG)}\n</tool_call>",
        f"On it.\n[TOOL_CALLS] [{_obj('search', _LONG, id='abc123XYZ')}, "
        f"{_obj('calc_2', {'x': _FILE})}]",
        f"<|python_tag|>{_obj('search', _LONG, 'parameters')}; "
        f"{_obj('calc_2', {'x': _FILE}, 'parameters')}",
        f"{_obj('calc_2', {'x': _FILE})}\n{_obj('search', _LONG, 'parameters')};\n"
        f"{_obj('calc_2', {})}",
    ],
    ids=["hermes", "mistral", "llama", "llama-newlines"],
)
def test_long_arguments_stream_in_pieces_as_they_are_written(text: str) -> None:
    content, calls = _parse(text)
    deltas = [text[i : i + 16] for i in range(0, len(text), 16)]
    client = _client(deltas)
    assert client.normalised() == calls
    assert client.content.strip() == (content or "")
    long_calls = [i for i, call in enumerate(calls) if call.arguments != "{}"]
    assert all(len(client.pieces[i]) > 1 for i in long_calls)
    # Before the answer ends (no finish yet), the first call came in pieces, the same ones.
    early = _client(deltas[:-1], finish=False)
    assert early.names[0] == calls[0].name and len(early.pieces[0]) > 1
    assert client.pieces[0][: len(early.pieces[0])] == early.pieces[0]


def test_a_block_that_closes_as_the_next_opens_keeps_each_calls_arguments() -> None:
    block = '<tool_call>{"name": "search", "arguments": {'
    deltas = [block, f"}}}}</tool_call>{block}", '"q": 1}}</tool_call>']
    assert _client(deltas).calls() == [("search", "{}"), ("search", '{"q": 1}')]


def test_calls_after_one_written_otherwise_come_whole_in_order() -> None:
    text = (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "a"}},'
        ' {"name": "calc_2", "arguments": "{\\"x\\": 1}"},'  # a string: not followed
        ' {"name": "search", "arguments": {"q": "b"}}]'
    )
    client = _client(list(text))
    assert client.calls() == [
        ("search", '{"q": "a"}'),
        ("calc_2", '{"x": 1}'),
        ("search", '{"q": "b"}'),
    ]
    assert [len(client.pieces[i]) for i in range(3)] == [len('{"q": "a"}'), 1, 1]


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        (
            '[TOOL_CALLS] [{"name": "search", "arguments": {"q": "a"}}, {"name": "nope"}]',
            '{"q": "a"}',
        ),
        ('{"name": "search", "parameters": {"q": "a"}} is what I would send', '{"q": "a"}'),
        ('{"name": "search", "parameters": {"q": "a", "n": 1', '{"q": "a", "n": 1'),  # cut
        ('<tool_call>{"name": "search", "arguments": {"q": "a"}, }</tool_call>', '{"q": "a"}'),
    ],
    ids=["mistral-bad-item", "llama-prose-after", "llama-cut", "hermes-malformed"],
)
def test_an_announced_call_found_not_to_be_one_is_not_taken_back(text: str, arguments: str) -> None:
    """As documented: its entry stays, and its text comes as content, as read whole."""
    assert _parse(text) == (text, [])
    client = _client(list(text))
    assert client.calls() == [("search", arguments)]
    assert client.content == text


def test_a_call_read_whole_otherwise_than_sent_is_sent_again() -> None:
    """As documented: a key written twice, JSON keeps the last; what went out stays."""
    text = '{"name": "search", "parameters": {"q": 1}, "parameters": {"q": 2}}'
    assert _parse(text) == (None, [ToolCall("search", '{"q": 2}')])
    assert _client(list(text)).calls() == [("search", '{"q": 1}'), ("search", '{"q": 2}')]


# -- generated texts -----------------------------------------------------------------------

_TEXT = st.text(alphabet=' \n\tabé日<>[]{}|;:"/_', max_size=8)
_FRAGMENTS = ["<", "[", "{", "}", "<tool", "[TOOL", "<|python_tag", "tool_call>", "</tool_call>"]
_FRAGMENTS += ["Hello", " x = {1: 2} ", "a < b", "[1, 2]", '{"name": 1}', "\n", "  ", "é"]
_CONTENT = (
    st.lists(st.one_of(st.sampled_from(_FRAGMENTS), _TEXT), max_size=5)
    .map("".join)
    .filter(lambda s: not any(m in s for m in MARKERS))
)
_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-1000, 1000), st.text(' ab日é<{["\\;\n', max_size=6)
)
_ARGS = st.dictionaries(
    st.text("abxyz_", min_size=1, max_size=5), _LEAF | st.lists(_LEAF), max_size=3
)


@st.composite
def _call_json(draw: st.DrawFn, keys: tuple[str, ...] = ("arguments", "parameters")) -> Case:
    """One call as a JSON object in some model's spelling, and the call it means."""
    name = draw(st.sampled_from(sorted(TOOLS)))
    args = draw(_ARGS)
    obj: dict[str, Any] = {"name": name}
    form = draw(
        st.sampled_from(["object", "string", "missing"] if not args else ["object", "string"])
    )
    if form != "missing":
        obj[draw(st.sampled_from(keys))] = args if form == "object" else json.dumps(args)
    text = json.dumps(
        obj, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2]))
    )
    return text, None, [ToolCall(name, _args(args))]


_BAD_BLOCKS = [
    "<tool_call>{broken</tool_call>",
    '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"q": 1}}</tool_call>',
    '<tool_call>["search"]</tool_call>',
]


@st.composite
def _hermes(draw: st.DrawFn) -> Case:
    text, content, calls = draw(_CONTENT), [], []
    content.append(text)
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            body, _, new = draw(_call_json())
            space = draw(st.sampled_from(["", "\n", " "]))
            text += f"<tool_call>{space}{body}{space}</tool_call>"
            calls += new
        else:
            block = draw(st.sampled_from(_BAD_BLOCKS))
            text += block
            content.append(block)
        between = draw(_CONTENT)
        text += between
        content.append(between)
    if draw(st.booleans()):  # a last block the model never closed
        body, _, new = draw(_call_json())
        text += "<tool_call>\n" + body + draw(st.sampled_from(["", "\n"]))
        calls += new
    return text, "".join(content).strip() or None, calls


@st.composite
def _mistral(draw: st.DrawFn) -> Case:
    before = draw(_CONTENT)
    objs: list[Any] = []
    calls: list[ToolCall] = []
    for _ in range(draw(st.integers(1, 3))):
        body, _, new = draw(_call_json(keys=("arguments",)))
        obj = json.loads(body)
        if draw(st.booleans()):
            obj["id"] = draw(st.text("abcXYZ019", min_size=9, max_size=9))
        objs.append(obj)
        calls += new
    text = before + "[TOOL_CALLS]" + draw(st.sampled_from(["", " "])) + json.dumps(objs)
    return text, before.strip() or None, calls


@st.composite
def _llama(draw: st.DrawFn) -> Case:
    bodies = draw(st.lists(_call_json(), min_size=1, max_size=3))
    separator = draw(st.sampled_from([";", "; ", "\n", " ;\n"]))
    lead = draw(st.sampled_from(["", " ", "\n"])) + draw(st.sampled_from(["", "<|python_tag|>"]))
    text = lead + separator.join(b for b, _, _ in bodies) + draw(st.sampled_from(["", "\n"]))
    return text, None, [c for _, _, calls in bodies for c in calls]


_CASES: st.SearchStrategy[Case] = st.one_of(
    _hermes(), _mistral(), _llama(), _CONTENT.map(lambda s: (s, s.strip() or None, []))
)


def _split(text: str, data: st.DataObject) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(case=_CASES, data=st.data())
def test_generated_texts_parse_and_stream_as_built(case: Case, data: st.DataObject) -> None:
    text, content, calls = case
    assert _parse(text) == (content, calls)
    deltas = _split(text, data)
    shown, streamed = _stream(deltas)
    assert streamed == calls
    assert "".join(shown).strip() == (content or "")
    client = _client(deltas)
    assert client.normalised() == calls
    assert client.content.strip() == (content or "")


_MESSY = [*_FRAGMENTS, *MARKERS, "<|python_tag|>", ";", '{"name": "search"}', "]"]
_MESSY += ['[{"name": "calc_2", "arguments": {}}]', '{"name": "nope"}', '"arguments": "{}"}']


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.sampled_from(_MESSY), _TEXT), max_size=12),
    data=st.data(),
)
def test_stream_agrees_with_parse_on_any_text(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    content, calls = _parse(text)
    deltas = _split(text, data)
    shown, streamed = _stream(deltas)
    assert streamed == calls
    assert "".join(shown).strip() == (content or "")
    client = _client(deltas)
    assert client.normalised() == calls
    assert client.content.strip() == (content or "")


# Pieces of calls as the formats write them, to be put together any which way: a call
# announced and then found not to be one cannot be taken back, so here the client may
# hold calls the whole answer does not; never fewer, and never out of order.
_CALL_PIECES = [
    '{"name": "search", "arguments": {"q": 1}}',
    "[TOOL_CALLS] [",
    '{"name": "search", "arguments": {',
    '{"name": "calc_2", "parameters": {"x": "}{;"}}',
    '"q": [1, "]"]',
    "}}",
    "}",
    ", ",
    "; ",
    "[{",
    '{"name": "nope", "arguments": {',
    '"id": "x1"',
]


def _is_subsequence(part: list[ToolCall], whole: list[ToolCall]) -> bool:
    rest = iter(whole)
    return all(any(call == other for other in rest) for call in part)


def _normalised_or_same(call: ToolCall) -> ToolCall:
    try:
        return ToolCall(call.name, _args(json.loads(call.arguments)))
    except ValueError:
        return call  # cut short: not JSON


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.sampled_from(_CALL_PIECES),
            st.sampled_from([*MARKERS, "<|python_tag|>", "</tool_call>", "]"]),
            st.sampled_from(_MESSY),
            _TEXT,
        ),
        max_size=14,
    ),
    data=st.data(),
)
def test_a_client_gets_every_call_of_the_whole_answer_in_order(
    pieces: list[str], data: st.DataObject
) -> None:
    text = "".join(pieces)
    content, calls = _parse(text)
    client = _client(_split(text, data))
    assert client.content.strip() == (content or "")
    got = [_normalised_or_same(ToolCall(name, args)) for name, args in client.calls()]
    assert _is_subsequence(calls, got)
