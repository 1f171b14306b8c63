"""A chat with tools as the chat template's inputs: the messages and the tool list.

    messages, tools = template_inputs(tokenizer.chat_template, submit.messages, submit.tools)
    ids = apply_chat_template(tokenizer, messages, tools)

A template that knows tools (Qwen2.5/3, Llama 3.1+, Hermes, Mistral: it reads `tools`)
gets them as transformers passes them: the tool list, assistant messages with
`tool_calls` (arguments as objects, as those templates print them) and `tool` messages
with their `tool_call_id`. A template that does not (the embedded SmolLM2's) would drop
them silently, so they are written into the conversation instead, in the Hermes format
that `chat_format.tool_calls` parses back: the tool list and how to call one in the system
message, earlier calls as `<tool_call>` blocks, results as `<tool_response>` blocks in
user messages (every template knows the user role).

Tools marked `strict` get SGLang's structural tag (`strict_tools_tag`) in the format the
model is asked to call in: Hermes, Mistral's `[TOOL_CALLS]` array or named call
(`[TOOL_CALLS]name[ARGS]{...}`) or Llama's JSON (`_call_format`); a template in another
format gets none (its calls are left free).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.protocol import ChatMessage, ChatToolCall

_HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The function "
    "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(chat_template: Any) -> bool:
    """Whether a chat template (a string, or a dict of named ones) reads `tools`."""
    return "tools" in str(chat_template or "")


def template_inputs(
    chat_template: Any, messages: Sequence[ChatMessage], tools_json: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`; tools None when the request had none
    or they are written into the messages."""
    tools = _tool_list(tools_json)
    if template_knows_tools(chat_template):
        return [_native(m) for m in messages], tools or None
    rendered = [_written_out(m) for m in messages]
    if tools:
        block = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{block}".lstrip()
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, None


@dataclass(frozen=True)
class _CallFormat:
    """How a chat format writes one call around its arguments object: `opening`, then
    `{"name": <the name as JSON>, "<key>": ` (`begin`), the arguments, then `end`. The
    model is free until it writes `trigger` (the format's marker; empty where it has
    none: then the call's own text through the name, `named`, so JSON in prose that
    names no tool is left alone)."""

    opening: str
    key: str
    end: str
    trigger: str

    def named(self, name: str) -> str:
        return f'{self.opening}{{"name": {json.dumps(name)}'

    def begin(self, name: str) -> str:
        return f'{self.named(name)}, "{self.key}": '

    def trigger_for(self, name: str) -> str:
        return self.trigger or self.named(name)


@dataclass(frozen=True)
class _NamedCallFormat:
    """Mistral's newer calls (Small 3.2, Devstral): `[TOOL_CALLS]<name>[ARGS]`, then the
    arguments object, nothing after it."""

    end: str = ""
    trigger: str = "[TOOL_CALLS]"

    def begin(self, name: str) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]"

    def trigger_for(self, name: str) -> str:
        return self.trigger


_HERMES = _CallFormat("<tool_call>\n", "arguments", "}\n</tool_call>", "<tool_call>")
_LLAMA = _CallFormat("", "parameters", "}", "")
# Mistral's templates print `[TOOL_CALLS] [` (v0.3) or `[TOOL_CALLS][` (Nemo) before the
# array; newer ones `[TOOL_CALLS]`, the name, then `[ARGS]` before the arguments.
_MISTRAL_ARRAY = re.compile(r"\[TOOL_CALLS\] ?\[")
_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\].*\[ARGS\]", re.DOTALL)
# Llama 3.1+/3.2: the tag before a call, or the format the template asks calls in.
_LLAMA_TEMPLATE = re.compile(r'<\|python_tag\|>|\{"name": function name, "parameters"')


def _call_format(chat_template: Any) -> _CallFormat | _NamedCallFormat | None:
    """The format the model is asked to write calls in, as `chat_format.tool_calls` reads them
    back: Hermes where the tools are written out (the template knows none) or the template
    prints `<tool_call>`; Mistral's array where it prints `[TOOL_CALLS] [` (spaced as it
    prints it), its named calls where it prints `[TOOL_CALLS]` and, after it, `[ARGS]`;
    Llama's JSON where it prints `<|python_tag|>` or asks for
    `{"name": function name, "parameters": ...}`; None for any other template."""
    template = str(chat_template or "")
    if not template_knows_tools(template) or "<tool_call>" in template:
        return _HERMES
    if mistral := _MISTRAL_ARRAY.search(template):
        return _CallFormat(mistral.group(), "arguments", "}]", "[TOOL_CALLS]")
    if _MISTRAL_NAMED.search(template):
        return _NamedCallFormat()
    if _LLAMA_TEMPLATE.search(template):
        return _LLAMA
    return None


def keeps_special_markers(chat_template: Any, specials: Collection[str]) -> bool:
    """Whether an answer that may call tools freely must keep special tokens in its text:
    the marker the template's call format opens each call with (`<tool_call>`,
    `[TOOL_CALLS]`) is one of `specials` (as Mistral's tokenizers make `[TOOL_CALLS]`),
    without which `chat_format.tool_calls` cannot tell calls from the content before them."""
    form = _call_format(chat_template)
    return form is not None and bool(form.trigger) and form.trigger in specials


def special_tokens(tokenizer: Any) -> frozenset[str]:
    """The texts of a tokenizer's special tokens (those `skip_special_tokens` drops)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {token.content for token in added.values() if getattr(token, "special", False)}
    return frozenset(specials | set(tokenizer.all_special_tokens))


def strict_tools_tag(chat_template: Any, tools_json: str | None) -> str | None:
    """SGLang's structural tag that holds calls of the tools marked `strict` (OpenAI's
    flag for arguments that follow the schema) to their schemas, while the model stays
    free to answer in text: once it writes the trigger of its format (`_call_format`), a
    call names one of the tools, a strict one's arguments match its schema and another's
    are any object. None when no tool is strict or the format is none of those."""
    form = _call_format(chat_template)
    functions = [t["function"] for t in _tool_list(tools_json) if t.get("type") == "function"]
    if form is None or not any(f.get("strict") for f in functions):
        return None
    structures = [
        {
            "begin": form.begin(f["name"]),
            "schema": (f.get("parameters") if f.get("strict") else None) or {"type": "object"},
            "end": form.end,
        }
        for f in functions
    ]
    triggers = list(dict.fromkeys(form.trigger_for(f["name"]) for f in functions))
    return json.dumps({"structures": structures, "triggers": triggers})


def _tool_list(tools_json: str | None) -> list[dict[str, Any]]:
    if not tools_json:
        return []
    tools = json.loads(tools_json)
    if not isinstance(tools, list):
        raise ValueError("tools must be a JSON list")
    return tools


def _arguments(call: ChatToolCall) -> Any:
    """A call's arguments as an object where they parse (templates print them with
    `tojson`), else the text as it came."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _native(message: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _written_out(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message.content}\n</tool_response>",
        }
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        calls = "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
            + "\n</tool_call>"
            for call in message.tool_calls
        )
        entry["content"] = f"{message.content}\n{calls}" if message.content else calls
    return entry
