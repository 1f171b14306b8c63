"""A chat with tools as the prompt the model sees (prep.tool_prompt through
PromptTokenizer), with the real SmolLM2 tokenizer: its template knows no tools, so they
are written into the conversation in the Hermes format; a template that reads `tools`
gets them, the assistant's calls and the tool results as transformers passes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.engine.model.tokenizer import load_tokenizer
from radixserve.prep import PrepError, PromptTokenizer, tokenizer_id
from radixserve.protocol import ChatMessage, ChatToolCall, SamplingParams, SubmitRequest
from tests.helpers.tiny_models import embedded_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    ChatMessage(role="system", content="You are terse."),
    ChatMessage(role="user", content="Weather in Oslo?"),
    ChatMessage(
        role="assistant",
        content="",
        tool_calls=[ChatToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
    ),
    ChatMessage(role="tool", content="12 C, rain", tool_call_id="call_1"),
]
# A template that reads tools, as Qwen2.5's does (abridged).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}|{% endfor %}[assistant]"
)


def _prompter(template: str | None = None) -> PromptTokenizer:
    folder = Path(embedded_model_dir())
    tokenizer = load_tokenizer(folder)
    if template is not None:
        tokenizer.chat_template = template
    return PromptTokenizer(tokenizer, 4096, tokenizer_id(folder))


def _text(prompter: PromptTokenizer, **fields: Any) -> str:
    req = SubmitRequest(
        rid="r-1", gateway_id="gw-1", sampling=SamplingParams(max_new_tokens=8), **fields
    )
    text: str = prompter.tokenizer.decode(prompter.prepare(req).ids)
    return text


def test_a_template_without_tools_gets_them_written_into_the_conversation() -> None:
    prompter = _prompter()
    text = _text(prompter, messages=CONVERSATION, tools=json.dumps(TOOLS))
    tools_line = json.dumps(TOOLS[0])
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert text.startswith("<|im_start|>system\nYou are terse.\n\nYou may call one or more")
    assert f"<tools>\n{tools_line}\n</tools>" in text
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n12 C, rain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # No system message of the client's: the tools get one of their own.
    alone = _text(prompter, messages=CONVERSATION[1:2], tools=json.dumps(TOOLS))
    assert alone.startswith("<|im_start|>system\nYou may call one or more functions")
    # Without tools (tool_choice "none"), earlier calls and results still show.
    plain = _text(prompter, messages=CONVERSATION)
    assert "<tools>" not in plain and f"<tool_call>\n{call}\n</tool_call>" in plain


def test_a_template_that_reads_tools_gets_them_as_transformers_passes_them() -> None:
    prompter = _prompter(TOOLS_TEMPLATE)
    text = _text(prompter, messages=CONVERSATION, tools=json.dumps(TOOLS))
    assert text == (
        f"TOOLS:{json.dumps(TOOLS[0])};|"
        "[system]You are terse.|"
        "[user]Weather in Oslo?|"
        '[assistant]CALL call_1 get_weather {"city": "Oslo"}|'
        "[tool]RESULT call_1 12 C, rain|"
        "[assistant]"
    )


def test_tools_that_are_not_a_json_list_are_a_400() -> None:
    with pytest.raises(PrepError) as info:
        _text(_prompter(), messages=CONVERSATION[:2], tools='{"not": "a list"}')
    assert info.value.param == "messages"


# -- strict tools: their calls held to the schema, the model otherwise free ---------------

STRICT_WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
STRICT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": STRICT_WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "now"}},  # not strict: any arguments
]


def _submit(**fields: Any) -> SubmitRequest:
    return SubmitRequest(
        rid="r-1",
        gateway_id="gw-1",
        messages=CONVERSATION[:2],
        sampling=fields.pop("sampling", SamplingParams(max_new_tokens=8)),
        **fields,
    )


def test_strict_tools_get_a_structural_tag_in_the_hermes_format() -> None:
    prompter = _prompter()  # SmolLM2: the tools are written out in the Hermes format
    req = prompter.with_strict_tools(_submit(tools=json.dumps(STRICT_TOOLS)))
    assert json.loads(req.sampling.structural_tag or "") == {
        "structures": [
            {
                "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                "schema": STRICT_WEATHER,
                "end": "}\n</tool_call>",
            },
            {  # not strict: any arguments object
                "begin": '<tool_call>\n{"name": "now", "arguments": ',
                "schema": {"type": "object"},
                "end": "}\n</tool_call>",
            },
        ],
        "triggers": ["<tool_call>"],
    }
    unchanged = [
        _submit(tools=json.dumps(TOOLS)),  # no strict tool
        _submit(),  # no tools
        # a grammar of its own (a forced call's schema)
        _submit(tools=json.dumps(STRICT_TOOLS), sampling=SamplingParams(json_schema="{}")),
    ]
    for plain in unchanged:
        assert prompter.with_strict_tools(plain) is plain
    # A template that reads tools but does not print <tool_call> (Llama 3's JSON form).
    llama_like = _prompter("{% if tools %}{{ tools | tojson }}{% endif %}")
    strict = _submit(tools=json.dumps(STRICT_TOOLS))
    assert llama_like.with_strict_tools(strict) is strict


def test_the_structural_tag_holds_strict_calls_to_their_schema() -> None:
    import xgrammar as xgr

    from radixserve.grammar import GrammarSource
    from radixserve.grammar.compile import XGrammarCompiler

    prompter = _prompter()
    req = prompter.with_strict_tools(_submit(tools=json.dumps(STRICT_TOOLS)))
    tokenizer = prompter.tokenizer
    compiler = XGrammarCompiler.for_tokenizer(tokenizer, len(tokenizer))
    compiled = compiler.compile(GrammarSource("structural_tag", req.sampling.structural_tag or ""))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n'
    good = f"Let me check. {call}</tool_call> Done."
    assert xgr.GrammarMatcher(compiled).accept_string(good)
    assert xgr.GrammarMatcher(compiled).accept_string("Just text, no call.")
    free = '<tool_call>\n{"name": "now", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert xgr.GrammarMatcher(compiled).accept_string(free)
    for bad in (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 9}}',
        '<tool_call>\n{"name": "delete_all", "arguments": {}}',
    ):
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), bad


def test_chat_template_kwargs_are_the_templates_variables() -> None:
    prompter = _prompter(
        "{% for m in messages %}{{ m.content }}|{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    off = _text(
        prompter, messages=CONVERSATION[:2], chat_template_kwargs='{"enable_thinking": false}'
    )
    assert off == "You are terse.|Weather in Oslo?|<think></think>"
    assert _text(prompter, messages=CONVERSATION[:2]) == "You are terse.|Weather in Oslo?|"


def test_continue_final_message_leaves_the_assistants_prefix_open() -> None:
    prompter = _prompter()
    prefix = ChatMessage(role="assistant", content='{"answer": ')
    text = _text(prompter, messages=[*CONVERSATION[:2], prefix], continue_final_message=True)
    assert text.endswith('<|im_start|>assistant\n{"answer": ')
    closed = _text(prompter, messages=[*CONVERSATION[:2], prefix])
    assert closed.endswith('{"answer": <|im_end|>\n<|im_start|>assistant\n')
