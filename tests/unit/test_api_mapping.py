"""HTTP bodies -> SubmitRequests: OpenAI and SGLang fields, defaults, every 400 with its
param, prompt lists, stop normalisation, and the ranges checked against the engine's own."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from radixserve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerationPlan,
    parse_body,
    plan_chat,
    plan_completion,
    plan_generate,
)
from radixserve.api.mapping import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    new_response_id,
)
from radixserve.api.prompts import normalize_stop
from radixserve.api.response_format import JSON_OBJECT_SCHEMA
from radixserve.engine.sampling import SamplingParams as EngineSamplingParams
from radixserve.protocol import ChatToolCall, SamplingParams

SERVED = "served-model"
GATEWAY = "gw-1"
USER = [{"role": "user", "content": "hi"}]


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _plan(endpoint: str, body: dict[str, Any], response_id: str = "rid-1") -> GenerationPlan:
    raw = json.dumps(body).encode()
    common: dict[str, Any] = {
        "response_id": response_id,
        "gateway_id": GATEWAY,
        "served_model": SERVED,
        "arrival_time": 123.0,
    }
    if endpoint == "chat":
        return plan_chat(parse_body(ChatCompletionRequest, raw), **common)
    if endpoint == "completion":
        return plan_completion(parse_body(CompletionRequest, raw), **common)
    return plan_generate(parse_body(GenerateRequest, raw), **common)


def _error(endpoint: str, body: dict[str, Any] | bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        if isinstance(body, bytes):
            model = {
                "chat": ChatCompletionRequest,
                "completion": CompletionRequest,
                "generate": GenerateRequest,
            }[endpoint]
            parse_body(model, body)
        else:
            _plan(endpoint, body)
    return info.value


# -- chat ----------------------------------------------------------------------------------


def test_chat_defaults() -> None:
    plan = _plan("chat", {"messages": USER})
    (submit,) = plan.submits
    assert (submit.rid, submit.gateway_id, submit.model, submit.arrival_time) == (
        "rid-1",
        GATEWAY,
        SERVED,
        123.0,
    )
    assert submit.text is None and submit.input_ids is None
    assert submit.messages is not None and submit.messages[0].content == "hi"
    expected = SamplingParams(max_new_tokens=CHAT_DEFAULT_MAX_TOKENS)
    assert submit.sampling == expected
    assert (plan.n, plan.stream, plan.include_usage, plan.logprobs) == (1, False, False, False)


def test_chat_maps_every_sampling_field() -> None:
    body = {
        "model": SERVED,
        "messages": USER,
        "n": 3,
        "stop": ["a", "", "b"],
        "max_tokens": 9,
        "max_completion_tokens": 20,  # wins over max_tokens
        "temperature": 0,  # an int is a fine float
        "top_p": 0.5,
        "seed": 42,
        "presence_penalty": -1.5,
        "frequency_penalty": 2,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "regex": "[a-z]+",
        "metadata": {"anything": "ignored"},  # unknown fields are ignored
    }
    plan = _plan("chat", body)
    s = plan.submits[0].sampling
    assert s == SamplingParams(
        max_new_tokens=20,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        min_p=0.05,
        frequency_penalty=2.0,
        presence_penalty=-1.5,
        repetition_penalty=1.1,
        stop=["a", "b"],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        min_new_tokens=2,
        n=3,
        seed=42,
        skip_special_tokens=False,
        return_logprob=True,
        top_logprobs_num=20,
        regex="[a-z]+",
    )
    assert (plan.n, plan.stream, plan.include_usage, plan.logprobs) == (3, True, True, True)
    assert plan.submits[0].stream is True


def test_chat_content_parts_are_flattened() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [
        {"role": "system", "content": "sys", "name": "boss"},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    submitted = _plan("chat", {"messages": messages}).submits[0].messages
    assert submitted is not None
    assert [(m.role, m.content, m.name) for m in submitted] == [
        ("system", "sys", "boss"),
        ("user", "one\ntwo", None),
        ("assistant", "", None),
    ]


def test_response_format_becomes_a_json_schema() -> None:
    as_object = _plan("chat", {"messages": USER, "response_format": {"type": "json_object"}})
    assert as_object.submits[0].sampling.json_schema == JSON_OBJECT_SCHEMA
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    as_schema = _plan("completion", {"prompt": "p", "response_format": fmt})
    assert json.loads(as_schema.submits[0].sampling.json_schema or "") == schema
    as_text = _plan("chat", {"messages": USER, "response_format": {"type": "text"}})
    assert as_text.submits[0].sampling.json_schema is None


# -- completions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "texts", "ids"),
    [
        ("one prompt", ["one prompt"], [None]),
        (["a", "b", "c"], ["a", "b", "c"], [None, None, None]),
        ([1, 2, 3], [None], [[1, 2, 3]]),
        ([[1, 2], [3]], [None, None], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_shapes(
    prompt: Any, texts: list[str | None], ids: list[list[int] | None]
) -> None:
    plan = _plan("completion", {"prompt": prompt, "n": 2}, response_id="cmpl-x")
    assert [s.text for s in plan.submits] == texts
    assert [s.input_ids_list for s in plan.submits] == ids
    if len(texts) == 1:
        assert plan.rids == ("cmpl-x",)
    else:
        assert plan.rids == tuple(f"cmpl-x-{i}" for i in range(len(texts)))
    assert plan.num_choices == 2 * len(texts)
    assert [plan.choice_index(p, c) for p in range(len(texts)) for c in range(2)] == list(
        range(2 * len(texts))
    )
    assert all(s.sampling.max_new_tokens == COMPLETION_DEFAULT_MAX_TOKENS for s in plan.submits)


def test_completion_echo_and_logprobs() -> None:
    plan = _plan("completion", {"prompt": ["x", "yz"], "echo": True, "logprobs": 0})
    assert plan.echo_texts == ("x", "yz")
    assert plan.logprobs is True
    s = plan.submits[0].sampling
    assert (s.return_logprob, s.top_logprobs_num) == (True, 0)
    no_logprobs = _plan("completion", {"prompt": "x", "logprobs": None}).submits[0].sampling
    assert no_logprobs.return_logprob is False


def test_new_response_ids() -> None:
    assert new_response_id("chat").startswith("chatcmpl-")
    assert new_response_id("completion").startswith("cmpl-")
    plain = new_response_id("generate")
    assert len(plain) == 32 and int(plain, 16) >= 0
    assert new_response_id("chat") != new_response_id("chat")


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("x", ["x"]), ([], []), (["a", "b"], ["a", "b"]), (["", "a"], ["a"]), ("", [])],
)
def test_normalize_stop(stop: Any, expected: list[str]) -> None:
    assert normalize_stop(stop) == expected


# -- /generate -------------------------------------------------------------------------------


def test_generate_uses_sglang_names_and_defaults() -> None:
    plan = _plan("generate", {"text": "t"})
    assert plan.submits[0].sampling == SamplingParams()  # SGLang's defaults, 128 tokens
    assert plan.batch is False
    params = {
        "max_new_tokens": 5,
        "min_new_tokens": 1,
        "temperature": 0.7,
        "stop": "END",
        "n": 2,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "ebnf": "root ::= 'a'",
    }
    body = {"input_ids": [7, 8], "sampling_params": params, "stream": True}
    body |= {"return_logprob": True, "top_logprobs_num": 3}
    plan = _plan("generate", body)
    s = plan.submits[0].sampling
    assert (s.max_new_tokens, s.min_new_tokens, s.temperature, s.stop, s.n) == (
        5,
        1,
        0.7,
        ["END"],
        2,
    )
    assert (s.no_stop_trim, s.spaces_between_special_tokens, s.ebnf) == (
        True,
        False,
        "root ::= 'a'",
    )
    assert (s.return_logprob, s.top_logprobs_num) == (True, 3)
    assert plan.submits[0].input_ids_list == [7, 8]
    assert plan.batch is True  # n > 1 answers a list
    assert plan.stream is True


def test_generate_batches() -> None:
    assert _plan("generate", {"text": ["a", "b"]}).batch is True
    ids = _plan("generate", {"input_ids": [[1], [2, 3]]})
    assert ids.batch is True and [s.input_ids_list for s in ids.submits] == [[1], [2, 3]]


# -- every 400 -------------------------------------------------------------------------------

_CHAT_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    # A turn without content (but an assistant's) is refused at once.
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, *USER]}, "messages[0].content"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_1"}]}, "messages[1].content"),
    ({"messages": USER, "temperature": -0.1}, "temperature"),
    ({"messages": USER, "temperature": "0.5"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "top_k": 0}, "top_k"),
    ({"messages": USER, "top_k": -2}, "top_k"),
    ({"messages": USER, "min_p": 1.5}, "min_p"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": 1.0}, "n"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"messages": USER, "stop": 3}, "stop"),
    ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"messages": USER, "seed": "1"}, "seed"),
    ({"messages": USER, "seed": 2**64}, "seed"),
    ({"messages": USER, "stream": 1}, "stream"),
    ({"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": USER, "logprobs": 1}, "logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "regex": "a", "ebnf": "b"}, "ebnf"),
    ({"messages": USER, "json_schema": "{}", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER, "function_call": "auto"}, "function_call"),
    ({"messages": USER, "tool_choice": "sometimes", "tools": [_tool("f")]}, "tool_choice"),
    ({"messages": USER, "tools": [_tool("f"), _tool("f")]}, "tools[1].function.name"),
    ({"messages": USER, "tools": [_tool("get weather")]}, "tools[0].function.name"),
    ({"messages": USER, "tools": [_tool("f", {"type": "array"})]}, "tools[0].function.parameters"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": USER, "tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": USER, "tools": [_tool("f")], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "tools": [_tool("f")], "tool_choice": "required", "regex": "a"}, "regex"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
]  # fmt: skip


def test_tools_the_model_may_not_call_run_as_plain_chat() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for body in (
        {"messages": USER, "tools": tools, "tool_choice": "none"},
        {"messages": USER, "tools": []},
        {"messages": USER, "tool_choice": "auto"},
    ):
        plan = _plan("chat", body)
        assert plan.tools is None and plan.submits[0].tools is None
        assert plan.submits[0].sampling.json_schema is None


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_tools_the_model_may_call_reach_the_template_unconstrained() -> None:
    tools = [_tool("get_weather", WEATHER), _tool("now")]
    for choice in (None, "auto"):
        plan = _plan("chat", {"messages": USER, "tools": tools, "tool_choice": choice})
        assert plan.tools is not None and plan.tools.mode == "auto"
        assert plan.tools.names == ("get_weather", "now")
        submit = plan.submits[0]
        assert submit.tools is not None and json.loads(submit.tools) == tools
        assert submit.sampling.json_schema is None


def test_a_named_tool_choice_constrains_the_answer_to_its_arguments() -> None:
    tools = [_tool("get_weather", WEATHER), _tool("now")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = _plan("chat", {"messages": USER, "tools": tools, "tool_choice": named})
    assert plan.tools is not None and plan.tools.mode == "named"
    assert json.loads(plan.submits[0].sampling.json_schema or "") == WEATHER
    bare = {"type": "function", "function": {"name": "now"}}
    plan = _plan("chat", {"messages": USER, "tools": tools, "tool_choice": bare})
    assert json.loads(plan.submits[0].sampling.json_schema or "") == {"type": "object"}


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_required_tool_choice_constrains_the_answer_to_a_list_of_calls(
    parallel: bool | None,
) -> None:
    tools = [_tool("get_weather", WEATHER), _tool("now")]
    body = {"messages": USER, "tools": tools, "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    plan = _plan("chat", body)
    assert plan.tools is not None and plan.tools.mode == "required"
    schema = json.loads(plan.submits[0].sampling.json_schema or "")
    expected: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "arguments": params,
                    },
                    "required": ["name", "arguments"],
                }
                for name, params in (("get_weather", WEATHER), ("now", {"type": "object"}))
            ]
        },
    }
    if parallel is False:
        expected["maxItems"] = 1
    assert schema == expected


def test_earlier_calls_and_their_results_reach_the_tokenizer() -> None:
    call = {"id": "call_7", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "call_7"},
    ]
    submitted = _plan("chat", {"messages": messages}).submits[0].messages
    assert submitted is not None
    assert submitted[1].tool_calls == [ChatToolCall(id="call_7", name="f", arguments="{}")]
    assert (submitted[2].role, submitted[2].content, submitted[2].tool_call_id) == (
        "tool",
        "done",
        "call_7",
    )


@pytest.mark.parametrize(("body", "param"), _CHAT_ERRORS)
def test_chat_errors_name_their_param(body: dict[str, Any], param: str) -> None:
    err = _error("chat", body)
    assert (err.status, err.type, err.code, err.param) == (
        400,
        "invalid_request_error",
        "invalid_request_error",
        param,
    )
    assert err.message


_COMPLETION_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({}, "prompt"),
    ({"prompt": "a", "logit_bias": {"x1": 2}}, "logit_bias"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "end"}, "suffix"),
    ({"prompt": "a", "logit_bias": {"-3": 2}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"3": 100.5}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"3": "up"}}, "logit_bias.3"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [2**31]}, "prompt[0]"),
    ({"prompt": [1, 2], "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
]


@pytest.mark.parametrize(("body", "param"), _COMPLETION_ERRORS)
def test_completion_errors_name_their_param(body: dict[str, Any], param: str) -> None:
    err = _error("completion", body)
    assert (err.status, err.param) == (400, param)


_GENERATE_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({}, "text"),
    ({"text": "a", "sampling_params": {"logit_bias": {"b": 1}}}, "sampling_params.logit_bias"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 2}}, "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "sampling_params": []}, "sampling_params"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), _GENERATE_ERRORS)
def test_generate_errors_name_their_param(body: dict[str, Any], param: str) -> None:
    err = _error("generate", body)
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize("raw", [b"", b"   ", b"{bad json", b"[]", b'"text"', b"null"])
def test_malformed_bodies_are_400_without_param(raw: bytes) -> None:
    for endpoint in ("chat", "completion", "generate"):
        err = _error(endpoint, raw)
        assert (err.status, err.param, err.type) == (400, None, "invalid_request_error")


@pytest.mark.parametrize(
    "raw", [b'{"messages": [], "temperature": NaN}', b'{"temperature": Infinity}']
)
def test_non_finite_numbers_are_refused(raw: bytes) -> None:
    err = _error("chat", raw)
    assert err.status == 400


def test_unknown_model_is_404_and_empty_model_is_fine() -> None:
    err = _error("chat", {"messages": USER, "model": "other"})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert _plan("chat", {"messages": USER, "model": ""}).model == SERVED
    assert _plan("completion", {"prompt": "x", "model": SERVED}).model == SERVED


# -- the ranges agree with the engine's ------------------------------------------------------

# Values on both sides of every bound the engine checks (`SamplingParams.validate`).
_BOUNDARIES: dict[str, list[Any]] = {
    "max_new_tokens": [-1, 0, 1, 4096],
    "temperature": [-0.01, 0, 0.5, 2, 7.5],
    "top_p": [-0.1, 0, 1e-9, 0.5, 1, 1.01],
    "top_k": [-2, -1, 0, 1, 50],
    "min_p": [-0.1, 0, 0.5, 1, 1.1],
    "frequency_penalty": [-2.01, -2, 0, 2, 2.01],
    "presence_penalty": [-2.01, -2, 0, 2, 2.01],
    "repetition_penalty": [-1, 0, 0.01, 1, 2, 2.01],
    "n": [-1, 0, 1, 8],
    "min_new_tokens": [-1, 0, 5],
    "stop_token_ids": [[-1], [0], [5]],
    "seed": [None, 0, 1234],
    "ignore_eos": [True, 1],
    "stop": ["x", ["a", "b"], 3],
}


def _engine_accepts(values: dict[str, Any]) -> bool:
    try:
        EngineSamplingParams.from_dict(values).validate(vocab_size=1000)
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize(
    ("name", "value"), [(name, v) for name, values in _BOUNDARIES.items() for v in values]
)
def test_gateway_and_engine_accept_the_same_values(name: str, value: Any) -> None:
    params: dict[str, Any] = {name: value}
    if name == "min_new_tokens":
        params["max_new_tokens"] = 10
    body = json.dumps({"text": "t", "sampling_params": params}).encode()
    try:
        plan = plan_generate(
            parse_body(GenerateRequest, body),
            response_id="r",
            gateway_id=GATEWAY,
            served_model=SERVED,
            arrival_time=0.0,
        )
    except ApiError as err:
        assert err.status == 400 and err.param is not None and name in err.param
        assert not _engine_accepts(params), f"gateway refused {name}={value!r}, engine accepts"
        return
    # What the gateway sends is exactly what the engine will be asked to accept.
    wire = msgspec.structs.asdict(plan.submits[0].sampling)
    assert _engine_accepts(wire), f"gateway accepted {name}={value!r}, engine refuses"


def test_logit_bias_reaches_the_engine_with_int_ids() -> None:
    chat = _plan("chat", {"messages": USER, "logit_bias": {"5": 3, "17": -100.0}})
    assert chat.submits[0].sampling.logit_bias == {5: 3.0, 17: -100.0}
    completion = _plan("completion", {"prompt": "a", "logit_bias": {"0": 0.5}})
    assert completion.submits[0].sampling.logit_bias == {0: 0.5}
    generate = _plan("generate", {"text": "a", "sampling_params": {"logit_bias": {"9": -1}}})
    assert generate.submits[0].sampling.logit_bias == {9: -1.0}
    assert (
        _plan("chat", {"messages": USER, "logit_bias": {}}).submits[0].sampling.logit_bias is None
    )


def test_continue_final_message_reaches_the_tokenizer() -> None:
    messages = [*USER, {"role": "assistant", "content": "Sure: "}]
    plan = _plan("chat", {"messages": messages, "continue_final_message": True})
    assert plan.submits[0].continue_final_message is True
    assert _plan("chat", {"messages": messages}).submits[0].continue_final_message is False
