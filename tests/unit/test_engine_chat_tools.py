"""`Engine.chat` with tools (engine/chat.py): the prompt and params the tokenizer service
builds for the same chat (prep), the answer's calls read back as the gateway reads them
(chat_format.tool_calls), bad messages refused; on a tiny Llama with the real SmolLM2 tokenizer
(its template knows no tools: they are written out in the Hermes format)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.engine.chat import chat_prompt
from radixserve.model_files.tokenizer import apply_chat_template
from radixserve.prep import PromptTokenizer
from radixserve.protocol import SamplingParams, SubmitRequest
from tests.unit.test_tool_prompt import CONVERSATION, MISTRAL_ARGS_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
# tests/unit/test_tool_prompt.py's CONVERSATION, as OpenAI's client sends it.
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(model_path=str(tiny_llama_dir), device="cpu", dtype="float32")


def _submitted(tools: list[dict[str, Any]]) -> SubmitRequest:
    return SubmitRequest(
        rid="r-1",
        gateway_id="gw-1",
        messages=CONVERSATION,  # as the gateway hands it to the tokenizer service
        tools=json.dumps(tools),
        sampling=SamplingParams(max_new_tokens=8),
    )


def test_the_prompt_and_params_are_the_tokenizer_services(engine: Engine) -> None:
    prompter = PromptTokenizer(engine.tokenizer, 4096, "tiny")
    ids, params = chat_prompt(engine.tokenizer, MESSAGES, [WEATHER], {"max_new_tokens": 8})
    assert ids == prompter.prepare(_submitted([WEATHER])).ids
    assert params == {"max_new_tokens": 8}  # no strict tool, no special marker
    _, strict = chat_prompt(engine.tokenizer, MESSAGES, [STRICT_WEATHER], None)
    tagged = prompter.with_strict_tools(_submitted([STRICT_WEATHER]))
    assert strict["structural_tag"] == tagged.sampling.structural_tag is not None
    # A grammar of the caller's own: no tag on top.
    _, own = chat_prompt(engine.tokenizer, MESSAGES, [STRICT_WEATHER], {"regex": "a+"})
    assert own == {"regex": "a+"}


def test_a_call_in_the_answer_comes_back_as_tool_calls(engine: Engine) -> None:
    forced = {"max_new_tokens": 64, "temperature": 0, "regex": re.escape(CALL)}
    out = engine.chat(MESSAGES, forced, tools=[WEATHER])
    assert out["text"] == CALL
    assert out["content"] is None
    (call,) = out["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_text_beside_a_call_is_the_content(engine: Engine) -> None:
    forced = {"max_new_tokens": 64, "temperature": 0, "regex": re.escape(f"Let me check. {CALL}")}
    out = engine.chat(MESSAGES, forced, tools=[WEATHER])
    assert out["content"] == "Let me check."
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_weather"]
    plain = engine.chat(MESSAGES, {"max_new_tokens": 8, "regex": "It rains"}, tools=[WEATHER])
    assert (plain["content"], plain["tool_calls"]) == ("It rains", [])


def test_chat_without_tools_renders_the_messages_as_before(engine: Engine) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    params = {"max_new_tokens": 6, "temperature": 0}
    out = engine.chat(messages, params)
    expected = engine.generate(
        input_ids=apply_chat_template(engine.tokenizer, messages), sampling_params=params
    )
    assert isinstance(expected, dict)
    assert out["output_ids"] == expected["output_ids"]
    assert "tool_calls" not in out


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "at least one message"),
        ([{"content": "Hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": {"text": "Hi"}}], r"messages\[0\]\.content"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}],
            r"messages\[0\]\.tool_calls\[0\]",
        ),
    ],
)
def test_bad_messages_are_value_errors(
    engine: Engine, messages: list[dict[str, Any]], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        engine.chat(messages, {"max_new_tokens": 4}, tools=[WEATHER])


def test_special_markers_stay_in_the_text_where_calls_need_them(tiny_llama_dir: Path) -> None:
    from radixserve.model_files.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = MISTRAL_ARGS_TEMPLATE
    _, params = chat_prompt(tokenizer, MESSAGES[:1], [WEATHER], None)
    assert params == {}  # `[TOOL_CALLS]` is plain text to this tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    _, params = chat_prompt(tokenizer, MESSAGES[:1], [WEATHER], None)
    assert params == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    _, params = chat_prompt(tokenizer, MESSAGES[:1], [WEATHER], {"skip_special_tokens": True})
    assert params == {"skip_special_tokens": True}  # the caller's choice stands
