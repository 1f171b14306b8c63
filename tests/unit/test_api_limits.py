"""Per-request bounds (`api.limits`): a body at each bound is planned, one past it is a 400
naming the field and the flag; flags, variables and defaults; the `priority` field."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from radixserve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerationPlan,
    RequestLimits,
    add_limit_arguments,
    limits_from,
    parse_body,
    plan_chat,
    plan_completion,
    plan_generate,
    with_priority,
)
from radixserve.api.limits import DEFAULT_LIMITS
from radixserve.protocol import SubmitRequest, decode, encode

USER = [{"role": "user", "content": "hi"}]
Body = dict[str, Any]


def _plan(endpoint: str, body: Body, limits: RequestLimits = DEFAULT_LIMITS) -> GenerationPlan:
    raw = json.dumps(body).encode()
    common: dict[str, Any] = {
        "response_id": "rid",
        "gateway_id": "gw-1",
        "served_model": "m",
        "arrival_time": 1.0,
        "limits": limits,
    }
    if endpoint == "chat":
        return plan_chat(parse_body(ChatCompletionRequest, raw), **common)
    if endpoint == "completion":
        return plan_completion(parse_body(CompletionRequest, raw), **common)
    return plan_generate(parse_body(GenerateRequest, raw), **common)


def _error(endpoint: str, body: Body, limits: RequestLimits = DEFAULT_LIMITS) -> ApiError:
    with pytest.raises(ApiError) as info:
        _plan(endpoint, body, limits)
    return info.value


def _compact_len(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _padded(base: dict[str, Any], key: str, size: int, measure: Callable[[Any], int]) -> Any:
    """`base` with `key` set to a string of x's making `measure(result) == size`."""
    empty = measure({**base, key: ""})
    return {**base, key: "x" * (size - empty)}


def _tool(name: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _schema_of(size: int) -> dict[str, Any]:
    """A parameters schema of exactly `size` bytes as compact JSON."""
    return _padded({"type": "object"}, "description", size, _compact_len)


def _tools_of(size: int) -> list[dict[str, Any]]:
    """One tool whose list is exactly `size` bytes as compact JSON (its description)."""
    return [_padded({"name": "f"}, "description", size, lambda f: _compact_len([_tool(**f)]))]


def _tool_list(size: int) -> list[dict[str, Any]]:
    return [_tool(**f) for f in _tools_of(size)]


def _response_schema_of(size: int) -> dict[str, Any]:
    """A response_format schema whose source (json.dumps, as the grammar hop gets it) is
    exactly `size` bytes."""
    schema = _padded({"type": "string"}, "description", size, lambda s: len(json.dumps(s)))
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _structural_tag_of(size: int) -> dict[str, Any]:
    def source(structure: dict[str, Any]) -> int:
        return len(json.dumps({"structures": [structure], "triggers": ["<f"]}))

    structure = _padded({"begin": "<f>", "schema": {}}, "end", size, source)
    return {"type": "structural_tag", "structures": [structure], "triggers": ["<f"]}


@dataclass(frozen=True)
class Case:
    endpoint: str
    limit: str  # the RequestLimits field
    param: str
    body: Callable[[int], Body]  # a body whose measured value is the argument

    @property
    def id(self) -> str:
        return f"{self.endpoint}-{self.limit}-{self.param}"


def _openai(endpoint: str, extra: Callable[[int], Body]) -> Callable[[int], Body]:
    base: Body = {"messages": USER} if endpoint == "chat" else {"prompt": "p"}
    return lambda k: {**base, **extra(k)}


def _native(extra: Callable[[int], Body]) -> Callable[[int], Body]:
    return lambda k: {"text": "p", "sampling_params": extra(k)}


# What chat and completions share, by their OpenAI (and SGLang-extra) names.
_SHARED: list[tuple[str, str, Callable[[int], Body]]] = [
    ("max_n", "n", lambda k: {"n": k}),
    ("max_output_tokens", "max_tokens", lambda k: {"max_tokens": k}),
    ("max_stop_strings", "stop", lambda k: {"stop": [f"s{i}" for i in range(k)]}),
    ("max_stop_string_chars", "stop", lambda k: {"stop": "x" * k}),
    ("max_stop_string_chars", "stop[1]", lambda k: {"stop": ["a", "é" * k]}),
    ("max_stop_token_ids", "stop_token_ids", lambda k: {"stop_token_ids": list(range(k))}),
    ("max_logit_bias", "logit_bias", lambda k: {"logit_bias": {str(i): 1 for i in range(k)}}),
    ("max_grammar_bytes", "regex", lambda k: {"regex": "x" * k}),
    ("max_grammar_bytes", "json_schema", lambda k: {"json_schema": "x" * k}),
    ("max_grammar_bytes", "ebnf", lambda k: {"ebnf": "x" * k}),
    ("max_grammar_bytes", "structural_tag", lambda k: {"structural_tag": "x" * k}),
    (
        "max_grammar_bytes",
        "response_format.json_schema.schema",
        lambda k: {"response_format": _response_schema_of(k)},
    ),
    (
        "max_grammar_bytes",
        "response_format.structures",
        lambda k: {"response_format": _structural_tag_of(k)},
    ),
]

CASES = [
    *(Case(ep, limit, param, _openai(ep, extra)) for ep in ("chat", "completion")
      for limit, param, extra in _SHARED),
    Case("chat", "max_output_tokens", "max_completion_tokens",
         _openai("chat", lambda k: {"max_completion_tokens": k})),
    Case("chat", "max_messages", "messages", lambda k: {"messages": USER * k}),
    Case("chat", "max_tools", "tools",
         _openai("chat", lambda k: {"tools": [_tool(f"f{i}") for i in range(k)]})),
    Case("chat", "max_tool_schema_bytes", "tools[1].function.parameters",
         _openai("chat", lambda k: {"tools": [_tool("a"), _tool("b", _schema_of(k))]})),
    Case("chat", "max_tools_bytes", "tools", _openai("chat", lambda k: {"tools": _tool_list(k)})),
    Case("completion", "max_prompts", "prompt", lambda k: {"prompt": ["p"] * k}),
    Case("completion", "max_prompts", "prompt", lambda k: {"prompt": [[1, 2]] * k}),
    Case("generate", "max_prompts", "text", lambda k: {"text": ["p"] * k}),
    Case("generate", "max_prompts", "input_ids", lambda k: {"input_ids": [[1]] * k}),
    *(Case("generate", limit, f"sampling_params.{param}", _native(extra))
      for limit, param, extra in _SHARED
      if param not in ("max_tokens",) and not param.startswith("response_format")),
    Case("generate", "max_output_tokens", "sampling_params.max_new_tokens",
         _native(lambda k: {"max_new_tokens": k})),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_body_at_the_bound_is_planned_and_one_past_it_is_a_400(case: Case) -> None:
    bound = getattr(DEFAULT_LIMITS, case.limit)
    plan = _plan(case.endpoint, case.body(bound))
    assert plan.submits
    err = _error(case.endpoint, case.body(bound + 1))
    assert (err.status, err.code, err.param) == (400, "invalid_request_error", case.param)
    # The message says the bound and how the server sets it.
    flag = "--" + case.limit.replace("_", "-")
    env = "$RADIXSERVE_" + case.limit.upper()
    assert f"{bound + 1} " in err.message and f" {bound} allowed" in err.message
    assert flag in err.message and env in err.message


def test_the_tool_choice_grammar_is_bounded_as_a_grammar() -> None:
    tools = [_tool(f"f{i}", _schema_of(2000)) for i in range(3)]
    for choice in ("required", {"type": "function", "function": {"name": "f1"}}):
        body = {"messages": USER, "tools": tools, "tool_choice": choice}
        schema = _plan("chat", body).submits[0].sampling.json_schema
        assert schema is not None
        size = len(schema.encode())
        assert _plan("chat", body, RequestLimits(max_grammar_bytes=size)).submits
        err = _error("chat", body, RequestLimits(max_grammar_bytes=size - 1))
        assert (err.status, err.param) == (400, "tools")
        assert "--max-grammar-bytes" in err.message


def test_configured_limits_replace_the_defaults() -> None:
    limits = RequestLimits(max_stop_strings=2, max_n=3)
    assert _plan("chat", {"messages": USER, "stop": ["a", "b"]}, limits).submits
    assert _error("chat", {"messages": USER, "stop": ["a", "b", "c"]}, limits).param == "stop"
    assert _error("generate", {"text": "t", "sampling_params": {"n": 4}}, limits).param == (
        "sampling_params.n"
    )
    # Past the old static MAX_N of 128 when the server allows it.
    many = _plan("completion", {"prompt": "p", "n": 200}, RequestLimits(max_n=200))
    assert many.n == 200


def test_defaults_are_kept_within_a_lower_output_bound() -> None:
    limits = RequestLimits(max_output_tokens=10)
    assert _plan("chat", {"messages": USER}, limits).submits[0].sampling.max_new_tokens == 10
    assert _plan("completion", {"prompt": "p"}, limits).submits[0].sampling.max_new_tokens == 10
    assert _plan("generate", {"text": "p"}, limits).submits[0].sampling.max_new_tokens == 10
    # Under the bound the endpoints' own defaults stand.
    assert _plan("completion", {"prompt": "p"}).submits[0].sampling.max_new_tokens == 16


def test_tool_sizes_ignore_the_clients_whitespace() -> None:
    # The same schema, pretty-printed, is measured as its compact JSON.
    schema = _schema_of(DEFAULT_LIMITS.max_tool_schema_bytes)
    raw = json.dumps({"messages": USER, "tools": [_tool("f", schema)]}, indent=4).encode()
    assert plan_chat(
        parse_body(ChatCompletionRequest, raw),
        response_id="r",
        gateway_id="g",
        served_model="m",
        arrival_time=0.0,
    ).tools


# -- RequestLimits, flags and variables ----------------------------------------------------

DOCUMENTED_DEFAULTS = {
    "max_n": 128,
    "max_output_tokens": 131072,
    "max_prompts": 1024,
    "max_messages": 2048,
    "max_stop_strings": 16,
    "max_stop_string_chars": 256,
    "max_stop_token_ids": 256,
    "max_logit_bias": 1024,
    "max_tools": 128,
    "max_tool_schema_bytes": 32768,
    "max_tools_bytes": 262144,
    "max_grammar_bytes": 65536,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway")
    add_limit_arguments(parser)
    return parser


def test_defaults_and_names() -> None:
    assert {k: getattr(RequestLimits(), k) for k in DOCUMENTED_DEFAULTS} == DOCUMENTED_DEFAULTS
    assert limits_from(_parser().parse_args([]), {}) == RequestLimits()
    text = _parser().format_help()
    for name, default in DOCUMENTED_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text
        assert f"$RADIXSERVE_{name.upper()} or {default}" in " ".join(text.split())


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    env = {"RADIXSERVE_MAX_STOP_STRINGS": "7", "RADIXSERVE_MAX_GRAMMAR_BYTES": " 100 "}
    flagged = limits_from(_parser().parse_args(["--max-stop-strings", "5"]), env)
    assert (flagged.max_stop_strings, flagged.max_grammar_bytes) == (5, 100)
    from_env = limits_from(_parser().parse_args([]), env)
    assert (from_env.max_stop_strings, from_env.max_n) == (7, 128)
    blank = limits_from(_parser().parse_args([]), {"RADIXSERVE_MAX_N": "  "})
    assert blank.max_n == 128
    # A namespace without the flags (a service that did not add them) reads the variables.
    assert limits_from(argparse.Namespace(), {"RADIXSERVE_MAX_TOOLS": "3"}).max_tools == 3


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5", "1e3"])
def test_a_bad_variable_is_a_value_error_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match="RADIXSERVE_MAX_LOGIT_BIAS"):
        limits_from(_parser().parse_args([]), {"RADIXSERVE_MAX_LOGIT_BIAS": value})


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_flag_is_refused_by_the_parser(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-messages", value])
    assert "--max-messages" in capsys.readouterr().err


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "8"])
def test_request_limits_refuse_a_bound_that_is_not_a_positive_integer(value: Any) -> None:
    with pytest.raises(ValueError, match="max_tools"):
        RequestLimits(max_tools=value)


# -- priority ------------------------------------------------------------------------------

_PRIORITY_BODIES: dict[str, Body] = {
    "chat": {"messages": USER},
    "completion": {"prompt": ["a", "b", "c"]},
    "generate": {"text": ["a", "b"]},
}


@pytest.mark.parametrize("endpoint", list(_PRIORITY_BODIES))
def test_priority_reaches_every_submit(endpoint: str) -> None:
    body = _PRIORITY_BODIES[endpoint]
    plan = _plan(endpoint, {**body, "priority": -7})
    assert plan.requested_priority == -7
    assert [s.priority for s in plan.submits] == [-7] * len(plan.submits)
    # It survives the bus.
    assert decode(encode(plan.submits[0]), SubmitRequest).priority == -7
    unset = _plan(endpoint, body)
    assert unset.requested_priority is None
    assert {s.priority for s in unset.submits} == {0}


@pytest.mark.parametrize("endpoint", list(_PRIORITY_BODIES))
@pytest.mark.parametrize("value", [1_000_000, -1_000_000, 0])
def test_priority_at_its_bounds_is_accepted(endpoint: str, value: int) -> None:
    plan = _plan(endpoint, {**_PRIORITY_BODIES[endpoint], "priority": value})
    assert {s.priority for s in plan.submits} == {value}


@pytest.mark.parametrize("endpoint", list(_PRIORITY_BODIES))
@pytest.mark.parametrize("value", [1_000_001, -1_000_001, "5", True, 1.5])
def test_priority_out_of_range_or_not_an_integer_is_a_400(endpoint: str, value: Any) -> None:
    raw = json.dumps({**_PRIORITY_BODIES[endpoint], "priority": value}).encode()
    model = {
        "chat": ChatCompletionRequest,
        "completion": CompletionRequest,
        "generate": GenerateRequest,
    }[endpoint]
    with pytest.raises(ApiError) as info:
        parse_body(model, raw)
    assert (info.value.status, info.value.param) == (400, "priority")


def test_priority_belongs_at_the_top_of_a_generate_body() -> None:
    err = _error("generate", {"text": "a", "sampling_params": {"priority": 1}})
    assert (err.status, err.param) == (400, "sampling_params.priority")


def test_with_priority_sets_every_submit_and_nothing_else() -> None:
    plan = _plan("completion", {"prompt": ["a", "b"], "priority": 50, "stop": "x"})
    clamped = with_priority(plan, 3)
    assert [s.priority for s in clamped.submits] == [3, 3]
    assert clamped.submits == tuple(msgspec.structs.replace(s, priority=3) for s in plan.submits)
    assert clamped.requested_priority == 50  # what the body asked, still known
    assert (clamped.rids, clamped.n, clamped.endpoint) == (plan.rids, plan.n, plan.endpoint)
    assert [s.priority for s in plan.submits] == [50, 50]  # the original is untouched
    for bad in (1_000_001, -1_000_001):
        with pytest.raises(ValueError, match="priority"):
            with_priority(plan, bad)
