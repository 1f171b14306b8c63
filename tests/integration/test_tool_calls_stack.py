"""Tool calling through the whole stack, driven with the `openai` client, against the
in-process engine on the same weights: a forced call (named or required) is the engine's
greedy answer under the same JSON schema, read back as `tool_calls`; a call the model
writes in its own format (Hermes, Mistral or Llama 3; here steered with the `regex`
extension, the tiny model being random) comes back as a tool call, streamed (its
arguments in pieces) or not; a conversation that sends the calls and their results back
is tokenized with the tools, as the engine's prompt would be."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from radixserve import Engine
from radixserve.api.chat_tools import plan_tools
from radixserve.api.openai_models import ChatCompletionRequest
from radixserve.chat_format.tool_calls import parse_tool_calls
from radixserve.prep import PromptTokenizer
from radixserve.protocol import ChatMessage, ChatToolCall, SubmitRequest
from tests.helpers.structured_cases import WEATHER
from tests.integration.stack_fixture import TINY_CONTEXT, RunningStack

pytestmark = pytest.mark.timeout(300)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    },
]
USER = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


@pytest.fixture()
def client(tiny_stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{tiny_stack.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def _prompt_ids(engine: Engine, messages: list[ChatMessage], tools: bool = True) -> list[int]:
    """The prompt the tokenizer service makes of a chat with TOOLS."""
    prompter = PromptTokenizer(engine.tokenizer, TINY_CONTEXT, "tiny")
    submit = SubmitRequest(
        rid="r", gateway_id="g", messages=messages, tools=json.dumps(TOOLS) if tools else None
    )
    return prompter.prepare(submit).ids


def _engine_text(engine: Engine, ids: list[int], schema: str) -> str:
    params = {"temperature": 0, "max_new_tokens": 96, "json_schema": schema}
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict)
    text: str = out["text"]
    return text


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_a_forced_call_is_the_engines_answer_under_the_same_schema(
    client: openai.OpenAI, tiny_stack: RunningStack, tiny_engine: Engine, tool_choice: Any
) -> None:
    parallel = False if tool_choice == "required" else None
    body = {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    schema = plan_tools(ChatCompletionRequest.model_validate(body))
    assert schema is not None and schema.schema is not None
    ids = _prompt_ids(tiny_engine, [ChatMessage(role="user", content=USER[0]["content"])])
    expected = json.loads(_engine_text(tiny_engine, ids, schema.schema))
    request: dict[str, Any] = {
        "model": tiny_stack.model,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 96,
        "parallel_tool_calls": parallel,
    }
    response = client.chat.completions.create(**request)
    assert response.usage is not None and response.usage.prompt_tokens == len(ids)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
    if tool_choice == "required":
        assert len(expected) == 1  # parallel_tool_calls false
        want = [(item["name"], item["arguments"]) for item in expected]
    else:
        want = [("get_weather", expected)]
    assert got == want
    for name, arguments in got:
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(arguments, params)
    # Streamed (a named call's arguments a piece at a time), the openai client's way of
    # putting the pieces together gives the same calls.
    _, streamed, _ = _streamed(client.chat.completions.create(**request, stream=True))
    assert [(name, json.loads("".join(pieces))) for name, pieces in streamed] == want


def _streamed(chunks: Any) -> tuple[str, list[tuple[str, list[str]]], list[str]]:
    """A streamed chat answer put together as a client does: its content, each call's
    name and argument pieces (by index), and the finish reasons."""
    content, reasons = "", []
    names: dict[int, str] = {}
    pieces: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id:
                    assert d.type == "function" and d.function is not None
                    names[d.index] = d.function.name or ""
                if d.function is not None and d.function.arguments:
                    pieces.setdefault(d.index, []).append(d.function.arguments)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content, [(names[i], pieces.get(i, [])) for i in sorted(names)], reasons


# What a model trained on each format writes; the tiny random model is steered to it.
_WEATHER_ARGUMENTS = r'\{"city": "(Oslo|Paris)", "days": [1-7]\}'
OWN_FORMATS = {
    "hermes": (
        r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        rf"{_WEATHER_ARGUMENTS}\}}\n</tool_call>",
        "Sure.",
    ),
    "mistral": (
        r'Sure\.\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": '
        rf"{_WEATHER_ARGUMENTS}\}}\]",
        "Sure.",
    ),
    "llama": (
        rf'<\|python_tag\|>\{{"name": "get_weather", "parameters": {_WEATHER_ARGUMENTS}\}}',
        None,
    ),
}


@pytest.mark.parametrize("form", sorted(OWN_FORMATS))
def test_a_call_in_the_models_own_format_is_read_back_streamed_or_not(
    client: openai.OpenAI, tiny_stack: RunningStack, form: str
) -> None:
    answer, want_content = OWN_FORMATS[form]
    common: dict[str, Any] = {
        "model": tiny_stack.model,
        "messages": USER,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 96,
        "extra_body": {"regex": answer},
    }
    response = client.chat.completions.create(**common)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == want_content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER)

    content, streamed, reasons = _streamed(client.chat.completions.create(**common, stream=True))
    assert content.strip() == (want_content or "")
    ((name, pieces),) = streamed
    assert name == "get_weather"
    # The arguments came a piece at a time as the model wrote them, and add up to them.
    assert len(pieces) > 1
    assert json.loads("".join(pieces)) == arguments
    assert reasons == ["tool_calls"]


def test_a_conversation_with_calls_and_results_is_tokenized_with_the_tools(
    client: openai.OpenAI, tiny_stack: RunningStack, tiny_engine: Engine
) -> None:
    arguments = '{"city": "Oslo", "days": 3}'
    messages: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"},
    ]
    conversation = [
        ChatMessage(role="user", content=USER[0]["content"]),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=[ChatToolCall(id="call_1", name="get_weather", arguments=arguments)],
        ),
        ChatMessage(role="tool", content="12 C and rain", tool_call_id="call_1"),
    ]
    for tools, choice in ((TOOLS, "auto"), (TOOLS, "none")):
        response = client.chat.completions.create(
            model=tiny_stack.model,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=4,
        )
        assert response.usage is not None
        expected = _prompt_ids(tiny_engine, conversation, tools=choice != "none")
        assert response.usage.prompt_tokens == len(expected)


def test_a_tool_choice_naming_no_given_tool_is_a_400(
    client: openai.OpenAI, tiny_stack: RunningStack
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=tiny_stack.model,
            messages=USER,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "send_email"}},
        )
    assert info.value.param == "tool_choice"


def test_a_tool_schema_the_grammar_service_refuses_names_the_tools(
    client: openai.OpenAI, tiny_stack: RunningStack
) -> None:
    bad = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=tiny_stack.model,
            messages=USER,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
        )
    assert (info.value.code, info.value.param) == ("invalid_grammar", "tools")


def test_strict_tools_the_model_may_call_match_the_engine_under_the_same_tag(
    client: openai.OpenAI, tiny_stack: RunningStack, tiny_engine: Engine
) -> None:
    """`strict` tools in auto mode: the tokenizer service adds the structural tag that
    holds their calls to the schemas; the answer equals the engine's under that tag."""
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    prompter = PromptTokenizer(tiny_engine.tokenizer, TINY_CONTEXT, "tiny")
    message = ChatMessage(role="user", content=USER[0]["content"])
    submit = SubmitRequest(rid="r", gateway_id="g", messages=[message], tools=json.dumps(tools))
    tag = prompter.with_strict_tools(submit).sampling.structural_tag
    assert tag is not None
    ids = prompter.prepare(submit).ids
    params = {"temperature": 0, "max_new_tokens": 24, "structural_tag": tag}
    expected = tiny_engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(expected, dict)
    response = client.chat.completions.create(
        model=tiny_stack.model,
        messages=USER,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
    )
    message_out = response.choices[0].message
    content, calls = parse_tool_calls(expected["text"], ("get_weather", "now"))
    if calls:
        assert message_out.content == content
        assert [(c.function.name, c.function.arguments) for c in message_out.tool_calls or []] == [  # type: ignore[union-attr]
            (c.name, c.arguments) for c in calls
        ]
    else:
        assert message_out.content == expected["text"] and not message_out.tool_calls


def test_a_strict_tool_schema_that_does_not_compile_names_the_tools(
    client: openai.OpenAI, tiny_stack: RunningStack
) -> None:
    bad = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=tiny_stack.model,
            messages=USER,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
        )
    assert (info.value.code, info.value.param) == ("invalid_grammar", "tools")
