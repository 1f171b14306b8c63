"""Response bodies for a finished request: chat, completions and `/generate`.

    body = chat_completion(plan, assembly, created=int(time.time()))

`usage` always carries `prompt_tokens_details.cached_tokens`, and with a reasoning
parser (chat) `completion_tokens_details.reasoning_tokens`. An OpenAI choice that
ended with finish kind `abort` has no OpenAI finish reason: the caller answers with
`abort_error(choice)` instead (`/generate` reports SGLang's `{"type": "abort"}`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.api.assembly import Assembly, ChoiceState, Usage
from radixserve.api.errors import SERVER_ERROR, ApiError
from radixserve.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    generate_logprobs,
    input_logprobs,
    prepend_logprobs,
)
from radixserve.api.mapping import GenerationPlan
from radixserve.chat_format.reasoning import split_reasoning
from radixserve.chat_format.tool_calls import tool_call_body
from radixserve.protocol import FinishReason

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event (`data: <json>` and a blank line)."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def openai_finish_reason(finish: FinishReason | None) -> str | None:
    if finish is None:
        return None
    return "length" if finish.kind == "length" else "stop"


def abort_error(choice: ChoiceState) -> ApiError:
    """What an OpenAI endpoint answers when the backend aborted a choice."""
    detail = choice.finish.message if choice.finish is not None else None
    return ApiError(
        500,
        f"the request was aborted by the server{': ' + detail if detail else ''}",
        SERVER_ERROR,
        None,
        "request_aborted",
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's `usage`, the same in a whole body and in a stream's last chunk."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def chat_finish_reason(finish: FinishReason | None, called: bool) -> str | None:
    """OpenAI's reason, "tool_calls" for an answer that called functions and was not
    cut short."""
    reason = openai_finish_reason(finish)
    return "tool_calls" if called and reason == "stop" else reason


def chat_choice_message(plan: GenerationPlan, choice: ChoiceState) -> dict[str, Any]:
    """The assistant message of a finished choice: its text, or the calls it made (and
    any text beside them) when the request had tools; with a reasoning parser, the
    reasoning apart (`reasoning_content`) and the rest read as above."""
    text = choice.text
    message: dict[str, Any] = {"role": "assistant"}
    if plan.reasoning_apart is not None:
        reasoning, text = split_reasoning(text, plan.reasoning_apart)
        message["reasoning_content"] = reasoning
    message["content"] = text
    if plan.tools is not None:
        content, calls = plan.tools.read(text)
        if calls:
            message["content"] = content
            message["tool_calls"] = [tool_call_body(call) for call in calls]
    return message


def chat_completion(plan: GenerationPlan, assembly: Assembly, created: int) -> dict[str, Any]:
    choices = []
    for c in assembly.choices:
        message = chat_choice_message(plan, c)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs) if plan.logprobs else None,
                "finish_reason": chat_finish_reason(c.finish, "tool_calls" in message),
            }
        )
    return {
        "id": plan.response_id,
        "object": "chat.completion",
        "created": created,
        "model": plan.model,
        "choices": choices,
        "usage": usage_body(assembly.usage()),
    }


def completion(plan: GenerationPlan, assembly: Assembly, created: int) -> dict[str, Any]:
    choices = []
    for c in assembly.choices:
        prefix = plan.echo_texts[c.prompt_index] if plan.echo_texts else ""
        logprobs = completion_logprobs(c.logprobs, len(prefix))[0] if plan.logprobs else None
        if logprobs is not None and plan.echo_texts and c.prompt_logprobs is not None:
            logprobs = prepend_logprobs(echo_logprobs(c.prompt_logprobs), logprobs)
        choices.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": logprobs,
                "finish_reason": openai_finish_reason(c.finish),
            }
        )
    return {
        "id": plan.response_id,
        "object": "text_completion",
        "created": created,
        "model": plan.model,
        "choices": choices,
        "usage": usage_body(assembly.usage()),
    }


def generate_finish_reason(finish: FinishReason | None) -> dict[str, Any] | None:
    """SGLang's `meta_info.finish_reason`: `{"type", "matched"?, "message"?}`."""
    if finish is None:
        return None
    body: dict[str, Any] = {"type": finish.kind}
    if finish.matched is not None:
        body["matched"] = finish.matched
    if finish.message is not None:
        body["message"] = finish.message
    return body


def generate_output(
    plan: GenerationPlan, assembly: Assembly, choice: ChoiceState, e2e_latency: float
) -> dict[str, Any]:
    """One `/generate` output (`text`, `output_ids`, `meta_info`)."""
    prompt_tokens, cached_tokens = assembly.prompt_usage(choice.prompt_index)
    meta: dict[str, Any] = {
        "id": choice.rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": choice.completion_tokens,
        "cached_tokens": cached_tokens,
        "finish_reason": generate_finish_reason(choice.finish),
        "e2e_latency": e2e_latency,
    }
    if plan.logprobs:
        with_top = any(s.sampling.top_logprobs_num > 0 for s in plan.submits)
        meta.update(generate_logprobs(choice.logprobs, with_top))
        if choice.prompt_logprobs is not None:
            meta.update(input_logprobs(choice.prompt_logprobs, with_top))
    output: dict[str, Any] = {
        "text": choice.text,
        "output_ids": choice.token_ids,
        "meta_info": meta,
    }
    if plan.batch:
        output["index"] = choice.index
    return output


def generate_result(
    plan: GenerationPlan, assembly: Assembly, e2e_latency: float
) -> dict[str, Any] | list[dict[str, Any]]:
    """One output, or a list for a batch / n > 1 (as SGLang answers)."""
    outputs = [generate_output(plan, assembly, c, e2e_latency) for c in assembly.choices]
    return outputs if plan.batch else outputs[0]
