"""Tool calls in streamed model text: the stream, which whatever the split into deltas
must agree with the whole-text parse and show plain content early; and the chat stream of
`auto` (`chat_tools.ToolStream`, calls followed by `arguments_stream`), which must give a
client the same calls, their arguments piece by piece as the model writes them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.chat_format.tool_calls import (
    BARE_ARRAY,
    BARE_NAMED,
    HERMES,
    LLAMA,
    MISTRAL,
    MISTRAL_NAMED,
    HeldCalls,
    ToolCall,
    ToolCallStream,
)
from tests.unit.tool_call_texts import (
    MARKERS,
    TOOLS,
    Case,
    args_json,
    client_of,
    parse,
    stream_text,
)

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


def test_stream_holds_a_named_call_until_finish() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("sea") == ("", [])  # may be the start of `search{`
    assert stream.feed('rch{"q": 1}') == ("", [])
    held = stream.held_calls
    assert held is not None and held.layout is BARE_NAMED and held.start == 0
    assert stream.finish() == ("", [ToolCall("search", '{"q": 1}')])
    stream = ToolCallStream(TOOLS)
    assert stream.feed("sea") == ("", [])
    assert stream.feed("rch the web") == ("search the web", [])
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Ok [TOOL_CALLS] ") == ("Ok ", [])
    assert stream.held_calls is None  # an array or a named call: not known yet
    assert stream.feed('search[ARGS]{"q": 1}') == ("", [])
    held = stream.held_calls
    assert held is not None and held.layout is MISTRAL_NAMED and held.start == 3
    assert stream.finish() == ("", [ToolCall("search", '{"q": 1}')])


def test_stream_holds_a_bare_array_until_finish() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed(" [") == ("", [])  # undecided: a bare array may follow
    assert stream.feed(' {"name": "search"}') == ("", [])
    held = stream.held_calls
    assert held is not None and held.layout is BARE_ARRAY and held.start == 0
    assert stream.feed("]") == ("", [])
    assert stream.finish() == ("", [ToolCall("search", "{}")])
    for text in ("[1, 2] are numbers", "[see](x) here"):
        stream = ToolCallStream(TOOLS)
        shown = [stream.feed(text[:1]), stream.feed(text[1:]), stream.finish()]
        assert "".join(content for content, _ in shown) == text
        assert all(not calls for _, calls in shown)
        assert shown[1][0]  # shown as soon as it is plainly not an array of calls


def test_stream_holds_leading_whitespace() -> None:
    stream = ToolCallStream(TOOLS)
    assert stream.feed("\n  ") == ("", [])
    assert stream.feed(" <|py") == ("", [])
    assert stream.feed("thon") == ("", [])
    assert stream.feed(" says hi") == ("<|python says hi", [])
    only_calls = ["\n ", '<tool_call>{"name": "search"}</tool_call>', "\n"]
    assert stream_text(only_calls) == (["", "", "", ""], [ToolCall("search", "{}")])


def test_stream_character_by_character() -> None:
    text = (
        'Checking {braces} <b>now</b>. <tool_call>{"name": "search", "arguments": "{}"}'
        '</tool_call> then [TOOL_CALLS][{"name": "calc_2", "arguments": {"x": 1}}]'
    )
    shown, calls = stream_text(list(text))
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
        f"On it.[TOOL_CALLS]search[ARGS]{json.dumps(_LONG)}"
        f"[TOOL_CALLS]calc_2[CALL_ID]a1B2c3D4e[ARGS]{json.dumps({'x': _FILE})}",
        f"search{json.dumps(_LONG)}\ncalc_2{json.dumps({'x': _FILE})}calc_2{{}}",
    ],
    ids=["hermes", "mistral", "llama", "llama-newlines", "mistral-named", "bare-named"],
)
def test_long_arguments_stream_in_pieces_as_they_are_written(text: str) -> None:
    content, calls = parse(text)
    deltas = [text[i : i + 16] for i in range(0, len(text), 16)]
    client = client_of(deltas)
    assert client.normalised() == calls
    assert client.content.strip() == (content or "")
    long_calls = [i for i, call in enumerate(calls) if call.arguments != "{}"]
    assert all(len(client.pieces[i]) > 1 for i in long_calls)
    # Before the answer ends (no finish yet), the first call came in pieces, the same ones.
    early = client_of(deltas[:-1], finish=False)
    assert early.names[0] == calls[0].name and len(early.pieces[0]) > 1
    assert client.pieces[0][: len(early.pieces[0])] == early.pieces[0]


def test_a_block_that_closes_as_the_next_opens_keeps_each_calls_arguments() -> None:
    block = '<tool_call>{"name": "search", "arguments": {'
    deltas = [block, f"}}}}</tool_call>{block}", '"q": 1}}</tool_call>']
    assert client_of(deltas).calls() == [("search", "{}"), ("search", '{"q": 1}')]


def test_calls_after_one_written_otherwise_come_whole_in_order() -> None:
    text = (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "a"}},'
        ' {"name": "calc_2", "arguments": "{\\"x\\": 1}"},'  # a string: not followed
        ' {"name": "search", "arguments": {"q": "b"}}]'
    )
    client = client_of(list(text))
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
    assert parse(text) == (text, [])
    client = client_of(list(text))
    assert client.calls() == [("search", arguments)]
    assert client.content == text


def test_a_call_read_whole_otherwise_than_sent_is_sent_again() -> None:
    """As documented: a key written twice, JSON keeps the last; what went out stays."""
    text = '{"name": "search", "parameters": {"q": 1}, "parameters": {"q": 2}}'
    assert parse(text) == (None, [ToolCall("search", '{"q": 2}')])
    assert client_of(list(text)).calls() == [("search", '{"q": 1}'), ("search", '{"q": 2}')]


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
    return text, None, [ToolCall(name, args_json(args))]


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
    form = draw(st.sampled_from(["array", "bare array", "named", "bare named"]))
    if form.endswith("named"):  # newer models: `[TOOL_CALLS]name[ARGS]{...}` a call
        marker, args_tag = ("", "") if form == "bare named" else ("[TOOL_CALLS]", "[ARGS]")
        if marker:
            args_tag = draw(st.sampled_from(["[ARGS]", "[CALL_ID]x1Y2z3W4v[ARGS]", "[ARGS] "]))
        else:
            before = draw(st.sampled_from(["", " ", "\n"]))
        between = draw(st.sampled_from(["", " ", "\n"])) if not marker else ""
        text = before + between.join(
            marker + obj["name"] + args_tag + json.dumps(json.loads(c.arguments))
            for obj, c in zip(objs, calls, strict=True)
        )
        return text, (before.strip() or None) if marker else None, calls
    if form == "bare array":  # the marker a special token, skipped: the array alone
        before = draw(st.sampled_from(["", " ", "\n"]))
        if draw(st.booleans()):  # strict calls: one an array
            between = draw(st.sampled_from(["", " ", "\n"]))
            return before + between.join(json.dumps([obj]) for obj in objs), None, calls
        return before + json.dumps(objs, indent=draw(st.sampled_from([None, 2]))), None, calls
    text = before + "[TOOL_CALLS]" + draw(st.sampled_from(["", " "])) + json.dumps(objs)
    return text, before.strip() or None, calls


@st.composite
def _llama(draw: st.DrawFn) -> Case:
    bodies = draw(st.lists(_call_json(), min_size=1, max_size=3))
    separator = draw(st.sampled_from([";", "; ", "\n", " ;\n", ";<|python_tag|>"]))
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
    assert parse(text) == (content, calls)
    deltas = _split(text, data)
    shown, streamed = stream_text(deltas)
    assert streamed == calls
    assert "".join(shown).strip() == (content or "")
    client = client_of(deltas)
    assert client.normalised() == calls
    assert client.content.strip() == (content or "")


_MESSY = [*_FRAGMENTS, *MARKERS, "<|python_tag|>", ";", '{"name": "search"}', "]"]
_MESSY += ["search", "calc_2{}", "[ARGS]", '{"q": 1}']
_MESSY += ['[{"name": "calc_2", "arguments": {}}]', '{"name": "nope"}', '"arguments": "{}"}']


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.sampled_from(_MESSY), _TEXT), max_size=12),
    data=st.data(),
)
def test_stream_agrees_with_parse_on_any_text(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    content, calls = parse(text)
    deltas = _split(text, data)
    shown, streamed = stream_text(deltas)
    assert streamed == calls
    assert "".join(shown).strip() == (content or "")
    client = client_of(deltas)
    # A call announced as it was written and then found not to be one (an answer that
    # opens like Llama's or a bare array, and goes on otherwise) stays announced.
    got = [_normalised_or_same(ToolCall(name, args)) for name, args in client.calls()]
    assert _is_subsequence(calls, got)
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
        return ToolCall(call.name, args_json(json.loads(call.arguments)))
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
    content, calls = parse(text)
    client = client_of(_split(text, data))
    assert client.content.strip() == (content or "")
    got = [_normalised_or_same(ToolCall(name, args)) for name, args in client.calls()]
    assert _is_subsequence(calls, got)
