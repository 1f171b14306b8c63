"""The `RequestLimits` checked: one function per concept, each a 400 naming the field,
the bound, and the flag that sets it.

    check_sampling(values, "sampling_params.", limits)   # n, stop, stop_token_ids, ...
    check_grammar(source, "regex", limits)

`mapping` calls these where a value enters (OpenAI chat and completions, native
`/generate`), so each bound reads the same from every endpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.api.errors import ApiError
from radixserve.api.limits import RequestLimits, configured_by
from radixserve.api.openai_models import ToolDef

# The grammar fields of the sampling values (SGLang's names), each its own param.
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


def _check(limits: RequestLimits, name: str, value: int, param: str, unit: str) -> None:
    bound: int = getattr(limits, name)
    if value > bound:
        raise ApiError.invalid(
            f"{param}: {value} {unit}, more than the {bound} allowed ({configured_by(name)})",
            param,
        )


def _json_bytes(value: Any) -> int:
    """The size of a JSON value as compact UTF-8, whatever the client's whitespace was."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_output_tokens(tokens: int, param: str, limits: RequestLimits) -> None:
    _check(limits, "max_output_tokens", tokens, param, "tokens")


def check_prompts(count: int, param: str, limits: RequestLimits) -> None:
    _check(limits, "max_prompts", count, param, "prompts")


def check_messages(count: int, limits: RequestLimits) -> None:
    _check(limits, "max_messages", count, "messages", "messages")


def check_stop(stop: str | Sequence[str] | None, param: str, limits: RequestLimits) -> None:
    """As the client sent it, so `stop[i]` names the string the client wrote at i."""
    if stop is None:
        return
    if isinstance(stop, str):
        _check(limits, "max_stop_string_chars", len(stop), param, "characters")
        return
    _check(limits, "max_stop_strings", len(stop), param, "stop strings")
    for i, item in enumerate(stop):
        _check(limits, "max_stop_string_chars", len(item), f"{param}[{i}]", "characters")


def check_grammar(source: str, param: str, limits: RequestLimits) -> None:
    """A grammar's source as the grammar service compiles it (UTF-8 bytes)."""
    _check(limits, "max_grammar_bytes", len(source.encode()), param, "bytes of grammar")


def check_sampling(values: Mapping[str, Any], prefix: str, limits: RequestLimits) -> None:
    """The sampling values (SGLang's names, as the client sent them, before `stop` and
    `logit_bias` are normalised) every endpoint shares; `prefix` puts them where the body
    has them (`sampling_params.` in `/generate`)."""
    if values.get("n") is not None:
        _check(limits, "max_n", values["n"], prefix + "n", "choices")
    check_stop(values.get("stop"), prefix + "stop", limits)
    if values.get("stop_token_ids") is not None:
        _check(
            limits,
            "max_stop_token_ids",
            len(values["stop_token_ids"]),
            prefix + "stop_token_ids",
            "stop token ids",
        )
    if values.get("logit_bias") is not None:
        _check(
            limits, "max_logit_bias", len(values["logit_bias"]), prefix + "logit_bias", "entries"
        )
    for name in GRAMMAR_FIELDS:
        if values.get(name) is not None:
            check_grammar(values[name], prefix + name, limits)


def check_tools(tools: Sequence[ToolDef], limits: RequestLimits) -> None:
    """Their number, each one's parameters schema, and all of them as the prompt gets them."""
    _check(limits, "max_tools", len(tools), "tools", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            size = _json_bytes(tool.function.parameters)
            _check(
                limits,
                "max_tool_schema_bytes",
                size,
                f"tools[{i}].function.parameters",
                "bytes of JSON",
            )
    size = _json_bytes([t.model_dump(exclude_none=True) for t in tools])
    _check(limits, "max_tools_bytes", size, "tools", "bytes of JSON")
