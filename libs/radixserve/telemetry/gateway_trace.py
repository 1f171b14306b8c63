"""The gateway's span of one HTTP generation request: the root of the request's trace.

    trace = RequestTrace(plan, parent=extract_trace(request.headers))
    with trace.active():                  # what is published now carries its traceparent
        await bus.publish(subjects.tokenize, ...)
    trace.first_token()
    trace.finish(status=200, prompt_tokens=..., ..., finish_reasons=["stop"])

Named `{gen_ai.operation.name} {gen_ai.request.model}` with the GenAI request and
usage attributes. A client that sends `traceparent` gets the span in its own trace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from radixserve.protocol import SamplingParams
from radixserve.telemetry import genai
from radixserve.telemetry.tracing import capture_content_enabled, get_tracer

if TYPE_CHECKING:
    from radixserve.api import GenerationPlan

_tracer = get_tracer("gateway")  # a proxy: real once setup_tracing installs a provider


class RequestTrace:
    def __init__(
        self, plan: GenerationPlan, parent: Context | None = None, tracer: Tracer | None = None
    ) -> None:
        self.plan = plan
        sampling = plan.submits[0].sampling if plan.submits else SamplingParams()
        attributes = genai.request_attributes(plan.endpoint, plan.model, sampling, plan.n)
        attributes[genai.RESPONSE_ID] = plan.response_id
        attributes[genai.REQUEST_ID] = plan.response_id
        self.span = (tracer or _tracer).start_span(
            genai.span_name(plan.endpoint, plan.model),
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    @contextmanager
    def active(self) -> Iterator[None]:
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def first_token(self) -> None:
        self.span.add_event(genai.EVENT_FIRST_TOKEN)

    def finish(
        self,
        *,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reasons: Sequence[str],
        error_type: str | None = None,
        error_message: str = "",
        outputs: Sequence[str] = (),
    ) -> None:
        span = self.span
        if not span.is_recording():
            return
        span.set_attributes(
            genai.usage_attributes(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
                finish_reasons=finish_reasons,
            )
        )
        span.set_attribute(genai.RESPONSE_MODEL, self.plan.model)
        span.set_attribute(genai.HTTP_STATUS, status)
        if error_type is not None:
            span.set_attribute(genai.ERROR_TYPE, error_type)
            span.set_status(Status(StatusCode.ERROR, error_message or error_type))
        if capture_content_enabled():
            span.set_attributes(genai.content_attributes(self._prompts(), outputs))
        span.end()

    def _prompts(self) -> list[Any]:
        prompts: list[Any] = []
        for submit in self.plan.submits:
            if submit.messages is not None:
                prompts.append(msgspec.to_builtins(submit.messages))
            elif submit.text is not None:
                prompts.append(submit.text)
            else:
                prompts.append(submit.input_ids_list)
        return prompts
