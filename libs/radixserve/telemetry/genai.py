"""OpenTelemetry GenAI semantic-convention attributes and radixserve's span names.

    span.set_attributes(request_attributes("chat", "smollm2", submit.sampling))
    span.set_attributes(usage_attributes(prompt_tokens=12, completion_tokens=5,
                                         cached_tokens=8, finish_reasons=["stop"]))

Only counts, ids and parameters: prompt and completion text are never put on a span
here. `content_attributes` is the one exception, used only when
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from radixserve.protocol import SamplingParams

OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
# radixserve's own
REQUEST_ID = "radixserve.request.id"
WORKER_ID = "radixserve.worker.id"
ERROR_CODE = "radixserve.error.code"
HTTP_STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"

PROVIDER = "radixserve"

# Span names of the services below the gateway (the gateway's is `{operation} {model}`,
# as the GenAI conventions name an inference span).
SPAN_TOKENIZE = "radixserve.tokenize"
SPAN_GRAMMAR_COMPILE = "radixserve.grammar.compile"
SPAN_GRAMMAR_FETCH = "radixserve.grammar.fetch"
SPAN_SCHEDULE = "radixserve.schedule"
SPAN_WORKER = "radixserve.worker.generate"
SPAN_DETOKENIZE = "radixserve.detokenize"
# Span events.
EVENT_QUEUED = "radixserve.queued"
EVENT_SCHEDULED = "radixserve.scheduled"
EVENT_FIRST_TOKEN = "gen_ai.first_token"

_OPERATIONS = {"chat": "chat", "completion": "text_completion", "generate": "text_completion"}


def operation_name(endpoint: str) -> str:
    """`chat` for /v1/chat/completions, `text_completion` for /v1/completions and /generate."""
    return _OPERATIONS.get(endpoint, "text_completion")


def span_name(endpoint: str, model: str) -> str:
    return f"{operation_name(endpoint)} {model}"


def request_attributes(
    endpoint: str, model: str, sampling: SamplingParams, n: int = 1
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        OPERATION_NAME: operation_name(endpoint),
        PROVIDER_NAME: PROVIDER,
        REQUEST_MODEL: model,
        REQUEST_MAX_TOKENS: sampling.max_new_tokens,
        REQUEST_TEMPERATURE: sampling.temperature,
        REQUEST_TOP_P: sampling.top_p,
    }
    if n != 1:
        attributes[REQUEST_CHOICE_COUNT] = n
    return attributes


def usage_attributes(
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    finish_reasons: Iterable[str] = (),
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        USAGE_INPUT_TOKENS: prompt_tokens,
        USAGE_OUTPUT_TOKENS: completion_tokens,
        USAGE_CACHED_INPUT_TOKENS: cached_tokens,
    }
    reasons = list(finish_reasons)
    if reasons:
        attributes[RESPONSE_FINISH_REASONS] = reasons
    return attributes


def content_attributes(prompts: Sequence[Any], outputs: Sequence[str]) -> dict[str, Any]:
    """Prompt and completion text, as JSON strings; only when capture is switched on."""
    return {
        INPUT_MESSAGES: json.dumps(list(prompts), default=str),
        OUTPUT_MESSAGES: json.dumps(list(outputs)),
    }
