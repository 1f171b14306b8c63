"""`Engine.chat` with tools: the conversation rendered as the tokenizer service renders it
(`chat_format.tool_prompt`), the answer's calls read back as the gateway reads them
(`chat_format.tool_calls`), in-process.

    ids, params = chat_prompt(tokenizer, messages, tools, sampling_params)
    out = engine.generate(input_ids=ids, sampling_params=params)
    add_tool_calls(out, tools)   # out["content"], out["tool_calls"] (OpenAI's shape)

Messages are OpenAI's chat messages as dicts (`content` text, None, or text parts;
assistant `tool_calls` and `tool` messages' `tool_call_id`); tools OpenAI's function
tools. The model may call them freely (OpenAI's `tool_choice: "auto"`): the template gets
them (or they are written into the conversation in the Hermes format), a tool marked
`strict` has its calls held to its schema (a structural tag, unless the caller's
sampling params bring a grammar of their own), and where the format's marker is a
special token the answer's text keeps special tokens, as in the service stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixserve.chat_format.tool_calls import parse_tool_calls, tool_call_body
from radixserve.chat_format.tool_prompt import (
    keeps_special_markers,
    special_tokens,
    strict_tools_tag,
    template_inputs,
)
from radixserve.engine.sampling.params import GRAMMAR_FIELDS
from radixserve.model_files.tokenizer import apply_chat_template
from radixserve.protocol import ChatMessage, ChatToolCall


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    sampling_params: Mapping[str, Any] | None,
) -> tuple[list[int], dict[str, Any]]:
    """The prompt's token ids and the sampling params to generate the answer with."""
    template = getattr(tokenizer, "chat_template", None)
    tools_json = json.dumps(list(tools)) if tools else None
    rendered, template_tools = template_inputs(template, chat_messages(messages), tools_json)
    ids = apply_chat_template(tokenizer, rendered, template_tools)
    params = dict(sampling_params or {})
    if tools_json is None or any(params.get(key) for key in GRAMMAR_FIELDS):
        return ids, params
    tag = strict_tools_tag(template, tools_json)
    if tag is not None:
        params["structural_tag"] = tag
    if "skip_special_tokens" not in params and keeps_special_markers(
        template, special_tokens(tokenizer)
    ):
        params |= {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    return ids, params


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """OpenAI's chat messages (dicts) -> the protocol's; ValueError naming what is wrong."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role must be a string")
        calls = [
            _tool_call(call, f"messages[{i}].tool_calls[{j}]")
            for j, call in enumerate(message.get("tool_calls") or ())
        ]
        out.append(
            ChatMessage(
                role=role,
                content=_text(message.get("content"), f"messages[{i}].content"),
                name=message.get("name"),
                tool_calls=calls or None,
                tool_call_id=message.get("tool_call_id"),
            )
        )
    return out


def add_tool_calls(out: dict[str, Any], tools: Sequence[Mapping[str, Any]]) -> None:
    """Read the answer's calls: `out["tool_calls"]` (OpenAI's entries, fresh ids) and
    `out["content"]` (the text beside them, None when none); `out["text"]` stays as the
    model wrote it."""
    names = [tool["function"]["name"] for tool in tools if tool.get("type") == "function"]
    content, calls = parse_tool_calls(out["text"], names)
    out["content"] = content
    out["tool_calls"] = [tool_call_body(call) for call in calls]


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") == "text" for part in content
    ):
        return "\n".join(str(part.get("text", "")) for part in content)
    raise ValueError(f"{where} must be text, None or a list of text parts")


def _tool_call(call: Any, where: str) -> ChatToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', ...}}}}"
        )
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ChatToolCall(id=str(call.get("id", "")), name=function["name"], arguments=arguments)
