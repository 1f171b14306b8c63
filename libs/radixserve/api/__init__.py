"""The HTTP API as a library: OpenAI and SGLang-native bodies, their mapping onto the
protocol, and the answers built from the detokenizer's `TextDelta`s.

    body = parse_body(ChatCompletionRequest, raw)              # ApiError 400 with `param`
    plan = plan_chat(body, response_id=..., gateway_id=..., served_model=..., arrival_time=...,
                     limits=limits_from(args))                 # past a bound: 400 with `param`
    plan = with_priority(plan, allowed)                        # the priority the caller may have
    assembly = Assembly(plan); assembly.apply(delta) ...       # deltas from the bus
    chat_completion(plan, assembly, created)                   # or make_streamer(...) for SSE

No FastAPI, NATS or Redis here: the gateway service wires these to HTTP and the bus.
"""

from __future__ import annotations

from radixserve.api.assembly import Assembly, ChoiceState, ChoiceUpdate, Usage
from radixserve.api.errors import ApiError, error_body, retry_after_header
from radixserve.api.limits import RequestLimits, add_limit_arguments, limits_from
from radixserve.api.mapping import (
    Endpoint,
    GenerationPlan,
    new_response_id,
    plan_chat,
    plan_completion,
    plan_generate,
    with_priority,
)
from radixserve.api.native_models import GenerateRequest
from radixserve.api.openai_models import ChatCompletionRequest, CompletionRequest
from radixserve.api.parsing import parse_body
from radixserve.api.responses import (
    SSE_DONE,
    abort_error,
    chat_completion,
    completion,
    generate_result,
    sse,
)
from radixserve.api.streaming import Streamer, make_streamer

__all__ = [
    "SSE_DONE",
    "ApiError",
    "Assembly",
    "ChatCompletionRequest",
    "ChoiceState",
    "ChoiceUpdate",
    "CompletionRequest",
    "Endpoint",
    "GenerateRequest",
    "GenerationPlan",
    "RequestLimits",
    "Streamer",
    "Usage",
    "abort_error",
    "add_limit_arguments",
    "chat_completion",
    "completion",
    "error_body",
    "generate_result",
    "limits_from",
    "make_streamer",
    "new_response_id",
    "parse_body",
    "plan_chat",
    "plan_completion",
    "plan_generate",
    "retry_after_header",
    "sse",
    "with_priority",
]
