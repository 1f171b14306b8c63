"""Chat answers of requests with tools: the model's text read back as OpenAI `tool_calls`
(finished and streamed), against hand-written expected bodies."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api import Assembly, chat_completion, make_streamer
from radixserve.api.mapping import GenerationPlan
from radixserve.protocol import FinishReason
from tests.unit.chat_answers import chat_plan, sse_payloads, text_delta

STOP = FinishReason(kind="stop")
LENGTH = FinishReason(kind="length")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _plan(**fields: Any) -> GenerationPlan:
    return chat_plan({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **fields})


def _finished(plan: GenerationPlan, text: str, finish: FinishReason = STOP) -> dict[str, Any]:
    assembly = Assembly(plan)
    assembly.apply(text_delta(text, finish))
    choice: dict[str, Any] = chat_completion(plan, assembly, 0)["choices"][0]
    return choice


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in message["tool_calls"]:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


def test_calls_in_the_models_own_format_become_tool_calls() -> None:
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    choice = _finished(_plan(), text)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert _calls(choice["message"]) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 2


def test_an_answer_without_calls_is_plain_content() -> None:
    text = "  It is sunny; call <tool_call>me</tool_call> later. "
    choice = _finished(_plan(), text)
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"


def test_forced_answers_are_read_as_calls() -> None:
    named = _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = _finished(named, '{"city": "Paris"}')
    assert choice["message"]["content"] is None
    assert _calls(choice["message"]) == [("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls"
    cut = _finished(named, '{"city": "Par', LENGTH)  # max_tokens: the partial arguments
    assert cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert cut["finish_reason"] == "length"
    required = _plan(tool_choice="required")
    text = (
        '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    choice = _finished(required, text)
    assert _calls(choice["message"]) == [("now", {}), ("get_weather", {"city": "Rome"})]
    cut = _finished(required, '[{"name": "now", "argu', LENGTH)
    assert cut["message"] == {"role": "assistant", "content": '[{"name": "now", "argu'}
    assert cut["finish_reason"] == "length"


def _stream(plan: GenerationPlan, pieces: list[str]) -> list[dict[str, Any]]:
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=1)
    choices: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        update = assembly.apply(text_delta(piece, STOP if i == len(pieces) - 1 else None))
        assert update is not None
        for chunk in sse_payloads(streamer.events(update, 0.0)):
            choices += chunk["choices"]
    return choices


def test_a_streamed_calls_arguments_come_as_the_model_writes_them() -> None:
    pieces = [
        "Sure",
        ". <tool",
        '_call>\n{"name": "get_',
        'weather", "arguments": ',
        '{"city": "Os',
        'lo"}}\n</tool_call>',
        "",
    ]
    choices = _stream(_plan(stream=True), pieces)
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content.strip() == "Sure."
    # "Sure" went out before the call was known: content is not held back.
    assert choices[1]["delta"] == {"content": "Sure"}
    entries = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    head, *rest = entries
    assert CALL_ID.fullmatch(head["id"]) and head["index"] == 0
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    # The arguments before the block closed, then the rest: never the call again whole.
    assert rest == [
        {"index": 0, "function": {"arguments": '{"city": "Os'}},
        {"index": 0, "function": {"arguments": 'lo"}'}},
    ]
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


@pytest.mark.parametrize(
    ("pieces", "content"),
    [
        (
            [
                "Sure. [TOOL",
                '_CALLS] [{"name": "get_weather", "arguments": {"city": "Os',
                'lo"}}, {"name": "now", "arguments": {',
                "}}]",
                "",
            ],
            "Sure.",
        ),
        (
            [
                '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Os',
                'lo"}};\n{"name": "now", "parameters": {',
                "}}",
                "",
            ],
            "",
        ),
    ],
    ids=["mistral", "llama"],
)
def test_mistral_and_llama_calls_stream_their_arguments_too(
    pieces: list[str], content: str
) -> None:
    choices = _stream(_plan(stream=True), pieces)
    assert "".join(c["delta"].get("content") or "" for c in choices).strip() == content
    entries = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    for entry in entries:
        if "id" in entry:
            assert CALL_ID.fullmatch(entry.pop("id")) and entry.pop("type") == "function"
    # Each call announced once the one before it closed, its arguments as they came.
    assert entries == [
        {"index": 0, "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Os'}},
        {"index": 0, "function": {"arguments": 'lo"}'}},
        {"index": 1, "function": {"name": "now", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{"}},
        {"index": 1, "function": {"arguments": "}"}},
    ]
    assert choices[-1]["finish_reason"] == "tool_calls"


_CALLS = st.sampled_from(
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b{\\"c"}}\n</tool_call>',
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "now", "parameters": {"x": [1, {"y": "}"}]}}</tool_call>',
        '<tool_call>{"arguments": {"q": 1}, "name": "now"}</tool_call>',  # name second: whole
        '<tool_call>{"name": "now", "arguments": "{\\"q\\": 1}"}</tool_call>',  # a string
        '<tool_call>{"name": "gone", "arguments": {}}</tool_call>',  # unknown: content
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n',  # left open
    ]
)
_TEXT = st.sampled_from(["Sure. ", "a { b } ", "\n", "< [ ", ""])


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.one_of(_CALLS, _TEXT), max_size=5),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_any_split_streams_the_calls_the_whole_answer_has(
    parts: list[str], cuts: list[int]
) -> None:
    if any(
        p.endswith("\n") and p.startswith("<tool_call>") and "</tool_call>" not in p
        for p in parts[:-1]
    ):
        return  # a block left open is only ever the last thing written
    text = "".join(parts)
    plan = _plan(stream=True)
    want_content, want_calls = plan.tools.read(text)  # type: ignore[union-attr]
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    choices = _stream(plan, [*pieces, ""])
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for c in choices:
        for entry in c["delta"].get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] not in names  # announced once
                names[entry["index"]] = entry["function"]["name"]
            arguments[entry["index"]] = (
                arguments.get(entry["index"], "") + entry["function"]["arguments"]
            )
    assert sorted(names) == list(range(len(names)))
    got = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    assert got == [(c.name, json.loads(c.arguments)) for c in want_calls]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content.strip() == (want_content or "")


def test_a_streamed_forced_call_comes_at_the_end() -> None:
    plan = _plan(stream=True, tool_choice="required")
    choices = _stream(plan, ['[{"name": "now", ', '"arguments": {}}]'])
    calls = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "now")]
    assert all(not c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_a_named_calls_arguments_stream_as_they_come() -> None:
    plan = _plan(stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choices = _stream(plan, ['{"city": ', '"Par', 'is"}', ""])
    entries = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
    first, *rest = entries
    assert CALL_ID.fullmatch(first["id"]) and first["type"] == "function"
    assert first["index"] == 0 and first["function"] == {
        "name": "get_weather",
        "arguments": '{"city": ',
    }
    assert rest == [
        {"index": 0, "function": {"arguments": '"Par'}},
        {"index": 0, "function": {"arguments": 'is"}'}},
    ]
    assert choices[-1]["finish_reason"] == "tool_calls"
    # Nothing generated at all: still the call, as the whole answer reads.
    empty = [c for c in _stream(plan, [""]) if "tool_calls" in c["delta"]]
    assert [c["delta"]["tool_calls"][0]["function"] for c in empty] == [
        {"name": "get_weather", "arguments": ""}
    ]
