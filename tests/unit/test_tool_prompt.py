"""A chat with tools as the prompt the model sees (chat_format.tool_prompt through
PromptTokenizer), with the real SmolLM2 tokenizer: its template knows no tools, so they
are written into the conversation in the Hermes format; a template that reads `tools`
gets them, the assistant's calls and the tool results as transformers passes them.
Strict tools get a structural tag in the call format the template asks for (Hermes,
Mistral, Llama 3): its calls read back by chat_format.tool_calls, compiled by xgrammar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.chat_format.tool_calls import (
    ToolCall,
    ToolCallStream,
    arguments_json,
    parse_tool_calls,
)
from radixserve.model_files.tokenizer import load_tokenizer, tokenizer_id
from radixserve.prep import PrepError, PromptTokenizer
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
    # A template that reads tools in none of the formats (no marker, no call format).
    unknown = _prompter("{% if tools %}{{ tools | tojson }}{% endif %}")
    strict = _submit(tools=json.dumps(STRICT_TOOLS))
    assert unknown.with_strict_tools(strict) is strict


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


# Excerpts of real templates, as they print the tools and an earlier call.
# Mistral-7B-Instruct-v0.3 (Nemo and Small 2409 print "[TOOL_CALLS][", no space).
MISTRAL_TEMPLATE = """
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and loop.first %}
            {{- "[AVAILABLE_TOOLS] " + tools|tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + "}[/TOOL_RESULTS]" }}
    {%- else %}
        {{- message["content"] }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_NEMO_TEMPLATE = MISTRAL_TEMPLATE.replace('"[TOOL_CALLS] ["', '"[TOOL_CALLS]["')
# Mistral Small 3.2 / Devstral: `[TOOL_CALLS]name[ARGS]{...}` a call, not an array.
MISTRAL_ARGS_TEMPLATE = """
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
    {%- for tool in message.tool_calls or [] %}
        {{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + tool['function']['arguments']|tojson }}
    {%- endfor %}
{%- endfor %}
"""
# Llama 3.2 (3.1 and 3.3 ask alike, and print `<|python_tag|>` for their built-in tools).
LLAMA_TEMPLATE = """
{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + message.content + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
"""
# Llama 3.1's built-in tool calls: the tag alone marks the format.
LLAMA_BUILTIN_TEMPLATE = """
{%- for message in messages %}{%- if tools and message.tool_calls %}
    {{- "<|python_tag|>" + message.tool_calls[0].function.name + ".call(" }}
{%- endif %}{%- endfor %}
"""


def _structures(begin: str, end: str) -> list[dict[str, Any]]:
    """The structures of STRICT_TOOLS in a format whose begin before the arguments is
    `begin` (with NAME for the function's name)."""
    return [
        {"begin": begin.replace("NAME", "get_weather"), "schema": STRICT_WEATHER, "end": end},
        {"begin": begin.replace("NAME", "now"), "schema": {"type": "object"}, "end": end},
    ]


FORMATS = {  # template -> the tag of STRICT_TOOLS
    "mistral": (
        MISTRAL_TEMPLATE,
        {
            "structures": _structures('[TOOL_CALLS] [{"name": "NAME", "arguments": ', "}]"),
            "triggers": ["[TOOL_CALLS]"],
        },
    ),
    "mistral-nemo": (
        MISTRAL_NEMO_TEMPLATE,
        {
            "structures": _structures('[TOOL_CALLS][{"name": "NAME", "arguments": ', "}]"),
            "triggers": ["[TOOL_CALLS]"],
        },
    ),
    "llama": (
        LLAMA_TEMPLATE,
        {  # no marker of its own: each call's text through the tool's name
            "structures": _structures('{"name": "NAME", "parameters": ', "}"),
            "triggers": ['{"name": "get_weather"', '{"name": "now"'],
        },
    ),
}
FORMATS["llama-builtin"] = (LLAMA_BUILTIN_TEMPLATE, FORMATS["llama"][1])
FORMATS["mistral-named"] = (
    MISTRAL_ARGS_TEMPLATE,
    {"structures": _structures("[TOOL_CALLS]NAME[ARGS]", ""), "triggers": ["[TOOL_CALLS]"]},
)


@pytest.mark.parametrize("name", list(FORMATS))
def test_strict_tools_get_a_structural_tag_in_the_templates_format(name: str) -> None:
    template, expected = FORMATS[name]
    req = _prompter(template).with_strict_tools(_submit(tools=json.dumps(STRICT_TOOLS)))
    assert json.loads(req.sampling.structural_tag or "") == expected


@pytest.mark.parametrize("name", ["mistral", "mistral-nemo", "mistral-named", "llama"])
def test_a_tags_begin_is_how_the_template_prints_an_earlier_call(name: str) -> None:
    template, expected = FORMATS[name]
    text = _text(_prompter(template), messages=CONVERSATION, tools=json.dumps(TOOLS))
    begin = expected["structures"][0]["begin"]
    assert f'{begin}{{"city": "Oslo"}}' in text


def _call_text(tag: str, name: str, arguments: dict[str, Any]) -> str:
    """What the tag's structure for `name` makes of `arguments`: begin + them + end."""
    structure = next(
        s
        for s in json.loads(tag)["structures"]
        if f'"name": {json.dumps(name)}' in s["begin"] or s["begin"].endswith(f"]{name}[ARGS]")
    )
    return f"{structure['begin']}{json.dumps(arguments)}{structure['end']}"


def _tag(template: str | None) -> str:
    req = _prompter(template).with_strict_tools(_submit(tools=json.dumps(STRICT_TOOLS)))
    assert req.sampling.structural_tag is not None
    return req.sampling.structural_tag


# The answers a model may write with each format's structures: the calls and the content.
ANSWERS = {
    "hermes": (None, "Let me check. {weather} {now}", "Let me check."),
    "mistral": (MISTRAL_TEMPLATE, "Let me check. {weather}{now}", "Let me check."),
    "mistral-nemo": (MISTRAL_NEMO_TEMPLATE, "{weather}\n{now}", None),
    "llama": (LLAMA_TEMPLATE, "{weather}; {now}", None),
    "llama-tagged": (LLAMA_TEMPLATE, "<|python_tag|>{weather}\n{now}", None),
    "mistral-named": (MISTRAL_ARGS_TEMPLATE, "Let me check. {weather}{now}", "Let me check."),
}
WEATHER_ARGS = {"city": "Rome", "days": 3}


@pytest.mark.parametrize("name", list(ANSWERS))
def test_a_structures_text_reads_back_as_the_call(name: str) -> None:
    template, answer, content = ANSWERS[name]
    tag = _tag(template)
    text = answer.format(
        weather=_call_text(tag, "get_weather", WEATHER_ARGS), now=_call_text(tag, "now", {})
    )
    expected = [
        ToolCall("get_weather", arguments_json(WEATHER_ARGS)),
        ToolCall("now", "{}"),
    ]
    names = ("get_weather", "now")
    assert parse_tool_calls(text, names) == (content, expected)
    for size in (1, 3, 7):  # streamed in small pieces, the same
        stream = ToolCallStream(names)
        shown, calls = "", []
        for piece in [text[i : i + size] for i in range(0, len(text), size)]:
            delta, new = stream.feed(piece)
            shown, calls = shown + delta, calls + new
        delta, new = stream.finish()
        assert ((shown + delta).strip() or None, calls + new) == (content, expected)


@pytest.mark.parametrize("name", ["mistral", "mistral-nemo", "mistral-named", "llama"])
def test_the_structural_tag_holds_strict_calls_to_their_schema_in_each_format(name: str) -> None:
    import xgrammar as xgr

    from radixserve.grammar import GrammarSource
    from radixserve.grammar.compile import XGrammarCompiler

    prompter = _prompter(FORMATS[name][0])
    tag = _tag(FORMATS[name][0])
    tokenizer = prompter.tokenizer
    compiler = XGrammarCompiler.for_tokenizer(tokenizer, len(tokenizer))
    compiled = compiler.compile(GrammarSource("structural_tag", tag))

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(compiled).accept_string(text))

    call = _call_text(tag, "get_weather", WEATHER_ARGS)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(call)  # and the answer may end after it
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    assert accepts("Just text, no call.")
    assert accepts(_call_text(tag, "now", {"zone": "UTC"}))  # not strict: any object
    for bad in ({"city": "Paris", "days": 3}, {"city": "Rome", "days": 9}, {"city": "Rome"}):
        assert not accepts(_call_text(tag, "get_weather", bad)), bad
    if name == "llama":  # JSON that names no tool is prose
        assert accepts('{"name": "Alice", "age": 3}')
    else:  # after the marker, a call to one of the tools
        assert not accepts(call.replace("get_weather", "delete_all"))


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


# -- special-token markers ---------------------------------------------------------------


def _mistral_prompter(template: str = MISTRAL_ARGS_TEMPLATE) -> PromptTokenizer:
    """The real tokenizer with Mistral's call markers as special tokens, as its own have."""
    prompter = _prompter(template)
    prompter.tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    return PromptTokenizer(prompter.tokenizer, 4096, prompter.tokenizer_id)


@pytest.mark.parametrize("template", [MISTRAL_ARGS_TEMPLATE, MISTRAL_TEMPLATE])
def test_free_calls_keep_special_markers_in_the_text(template: str) -> None:
    prompter = _mistral_prompter(template)
    req = prompter.with_call_markers(_submit(tools=json.dumps(TOOLS)))
    assert req.sampling.skip_special_tokens is False
    assert req.sampling.spaces_between_special_tokens is False
    # Then a strict tool's tag on top (the tokenizer service's order): both hold.
    both = prompter.with_strict_tools(
        prompter.with_call_markers(_submit(tools=json.dumps(STRICT_TOOLS)))
    )
    assert both.sampling.skip_special_tokens is False and both.sampling.structural_tag


def test_special_markers_are_dropped_as_usual_otherwise() -> None:
    mistral = _mistral_prompter()
    unchanged = [
        (mistral, _submit()),  # no tools
        # a grammar of its own (a forced call's schema)
        (mistral, _submit(tools=json.dumps(TOOLS), sampling=SamplingParams(json_schema="{}"))),
        (_prompter(MISTRAL_ARGS_TEMPLATE), _submit(tools=json.dumps(TOOLS))),  # not special
        (_prompter(LLAMA_TEMPLATE), _submit(tools=json.dumps(TOOLS))),  # no marker
        (_prompter(), _submit(tools=json.dumps(TOOLS))),  # Hermes written out, not special
    ]
    for prompter, req in unchanged:
        assert prompter.with_call_markers(req) is req


@pytest.mark.parametrize("skip", [True, False])
def test_named_calls_read_back_from_the_tokens_either_way(skip: bool) -> None:
    from radixserve.detok.incremental import batch_decode

    tokenizer = _mistral_prompter().tokenizer
    calls = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}[TOOL_CALLS]now[ARGS]{}'
    ids = tokenizer.encode(calls, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    (text,) = batch_decode(
        tokenizer, [ids], skip_special_tokens=skip, spaces_between_special_tokens=False
    )
    assert ("[TOOL_CALLS]" in text) is not skip
    expected = [ToolCall("get_weather", arguments_json(WEATHER_ARGS)), ToolCall("now", "{}")]
    assert parse_tool_calls(text, ("get_weather", "now")) == (None, expected)
    # Content before the calls reads back only with the markers kept.
    prose = tokenizer.encode("Let me check. ", add_special_tokens=False)
    (text,) = batch_decode(
        tokenizer, [prose + ids], skip_special_tokens=skip, spaces_between_special_tokens=False
    )
    content, found = parse_tool_calls(text, ("get_weather", "now"))
    assert (content, found) == (("Let me check.", expected) if not skip else (text, []))
