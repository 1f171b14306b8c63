"""Tool calls in model text, read whole: the Hermes/Qwen, Mistral and Llama formats, and
what stays content (broken JSON, unknown names, prose with braces). The stream's tests
are in test_tool_call_stream.py."""

from __future__ import annotations

import pytest

from radixserve.chat_format.tool_calls import ToolCall
from tests.unit.tool_call_texts import parse

# -- Hermes / Qwen -------------------------------------------------------------------------


def test_hermes_one_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_hermes_calls_among_content() -> None:
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        "and\n"
        '<tool_call>  {"name":"search","arguments":{"q":"café","n":2}}  </tool_call>'
        " Done."
    )
    assert parse(text) == (
        "Let me check.\n\nand\n Done.",
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("search", '{"q": "café", "n": 2}')],
    )


def test_hermes_unterminated_last_block() -> None:
    text = (
        '<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n'
        '<tool_call>\n{"name": "calc_2", "arguments": {"x": [1, 2]}}\n'
    )
    assert parse(text) == (
        None,
        [ToolCall("search", '{"q": "a"}'), ToolCall("calc_2", '{"x": [1, 2]}')],
    )


def test_hermes_unterminated_broken_block_is_content() -> None:
    text = 'Sure <tool_call>{"name": "search", "arguments": {"q":'
    assert parse(text) == (text, [])


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
    assert parse(f"<tool_call>{body}</tool_call>") == (None, [ToolCall("search", arguments)])


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
    assert parse(text) == (text, [])
    good = '<tool_call>{"name": "search"}</tool_call>'
    assert parse(f"{block}\n{good}") == (block, [ToolCall("search", "{}")])


# -- Mistral -------------------------------------------------------------------------------


def test_mistral_one_call() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_mistral_several_calls_with_ids_and_content_before() -> None:
    text = (
        "I will look both up.\n[TOOL_CALLS]"
        '[{"name": "search", "arguments": {"q": "a"}, "id": "abc123DEF"},'
        ' {"name": "calc_2", "arguments": "{\\"x\\": 1}", "id": "xyz987abc"},'
        ' {"name": "search"}]'
    )
    assert parse(text) == (
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
    assert parse(text) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "search", "arguments": {"q": "a"}}, {"name": "calc_2"}]',
        # strict calls: one an array; their markers skipped
        ' [{"name": "search", "arguments": {"q": "a"}}] [{"name": "calc_2"}]',
        '[{"name": "search", "arguments": {"q": "a"}}]\n[{"name": "calc_2"}]',
    ],
)
def test_mistral_bare_arrays_of_several_calls(text: str) -> None:
    assert parse(text) == (None, [ToolCall("search", '{"q": "a"}'), ToolCall("calc_2", "{}")])


def test_mistral_strict_calls_with_their_markers() -> None:
    text = '[TOOL_CALLS] [{"name": "search", "arguments": {}}][TOOL_CALLS] [{"name": "calc_2"}]'
    assert parse(text) == (None, [ToolCall("search", "{}"), ToolCall("calc_2", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "search", "arguments": {}}] and then some words',  # not the whole answer
        'Calls: [{"name": "search", "arguments": {}}]',
        '[{"name": "search"}, {"name": "nope"}]',  # one bad: all content
        '[{"name": "search"}, 3]',
        '[{"name": "search"}] [{"name": "nope"}]',  # a second array that is not calls
        '[{"name": "search"}] {"name": "calc_2"}',
        '[{"name": "search", "arguments": {"q":',  # cut off
        "[{}]",
        "[]",
        "[1, 2]",
        "[see the docs](https://example.com)",
    ],
)
def test_not_a_bare_array_stays_content(text: str) -> None:
    assert parse(text) == (text, [])


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('Looking.[TOOL_CALLS]search[ARGS]{"q": "a"}[TOOL_CALLS]calc_2[ARGS]{}', "Looking."),
        ('search{"q": "a"}calc_2{}', None),
        ('search{"q": "a"}\ncalc_2{}', None),
    ],
)
def test_mistral_named_calls_one_after_another(text: str, content: str | None) -> None:
    assert parse(text) == (content, [ToolCall("search", '{"q": "a"}'), ToolCall("calc_2", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]nope[ARGS]{}",  # unknown name
        '[TOOL_CALLS]search[ARGS]{"q":',  # cut off
        "[TOOL_CALLS]search[ARGS][1]",  # arguments not an object
        '[TOOL_CALLS]search[ARGS]"x"',
        'search{"q": 1} and some words',  # not the whole answer
        'Try search{"q": 1}',
        'search {"q": 1}',  # bare: the name right before the brace, or prose
        "nope{}",
        "search{}; calc_2{}",
    ],
)
def test_not_a_named_call_stays_content(text: str) -> None:
    assert parse(text) == (text, [])


# -- Llama 3.x -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '  \n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|> {"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}',
        # Mistral's named calls (newer models), with their special tokens or without
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS] {"city": "Paris"}',
        '[TOOL_CALLS] get_weather{"city": "Paris"}',
        'get_weather{"city": "Paris"}',
        ' \nget_weather{"city":"Paris"}\n',
        # Mistral's tokenizers make [TOOL_CALLS] a special token: skipped, the array is left.
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        ' [ {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}", "id": "a1"} ]\n',
    ],
)
def test_llama_or_named_one_call(text: str) -> None:
    assert parse(text) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize(
    "separator", [";", "; ", "\n", " ;\n", "\n\n", ";<|python_tag|>", "\n<|python_tag|> "]
)
def test_llama_several_calls(separator: str) -> None:
    text = separator.join(['{"name": "search", "parameters": {"q": "a;b"}}', '{"name": "calc_2"}'])
    assert parse(text) == (None, [ToolCall("search", '{"q": "a;b"}'), ToolCall("calc_2", "{}")])


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
    assert parse(text) == (text.strip(), [])


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
    assert parse(text) == (text.strip() or None, [])
