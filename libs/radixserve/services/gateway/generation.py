"""The three generation endpoints as one flow: parse, plan, publish, wait, answer.

A streamed request waits for its first event before answering, so an error that
comes before any token (400 context length, 429 queue full, 503 no worker, ...)
still gets its own HTTP status and headers; an error after the first chunk is sent
as an SSE `{"error": ...}` event, which the OpenAI clients raise.

A stream writes the events of every update already there when it gets its turn as
one body part (one socket write), each update still its own event(s) in order; it
never waits for more. The last events ([DONE] and what comes with it) go out with the
end of the body.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.api import (
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    ChoiceUpdate,
    CompletionRequest,
    Endpoint,
    GenerateRequest,
    GenerationPlan,
    abort_error,
    chat_completion,
    completion,
    generate_result,
    make_streamer,
    new_response_id,
    parse_body,
    plan_chat,
    plan_completion,
    plan_generate,
    sse,
    with_priority,
)
from radixserve.auth import ApiKey
from radixserve.bus.tracing import extract_trace
from radixserve.services.gateway.auth import api_key_of
from radixserve.services.gateway.inflight import ClientDisconnected, Inflight
from radixserve.services.gateway.responses import REQUEST_ID_HEADER, error_response, json_response
from radixserve.services.gateway.state import GatewayState


class SSEResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed, or the client
    gone (Starlette then cancels the body iterator, which may never resume)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self._parts = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but a part that ends with [DONE] also ends the body (one write
        where Starlette sends an empty last part after it)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        more = True
        async for part in self._parts:
            more = not part.endswith(SSE_DONE)
            await send({"type": "http.response.body", "body": part, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# A body this many times the bus's max_payload cannot fit in it, even after JSON escapes
# (6 bytes of a \u escape for up to 3 of text) shrink: refused before it is parsed.
BODY_LIMIT_PAYLOADS = 4


async def _bounded_body(state: GatewayState, request: Request) -> bytes:
    """The request body, or a 413 past BODY_LIMIT_PAYLOADS x the bus's max_payload (by
    its Content-Length before reading, else as it streams in)."""
    limit = BODY_LIMIT_PAYLOADS * state.bus.nats_client.max_payload
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _body_too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _body_too_large(limit)
    return bytes(body)


def _body_too_large(limit: int) -> ApiError:
    return ApiError.too_large(f"the request body is larger than {limit} bytes")


async def handle_generation(state: GatewayState, request: Request, endpoint: Endpoint) -> Response:
    response_id = new_response_id(endpoint)
    try:
        state.check_accepting()
        plan = _plan(state, endpoint, response_id, await _bounded_body(state, request))
        api_key = api_key_of(request.scope)
        plan = with_priority(plan, priority_of(plan.requested_priority, api_key))
    except ApiError as exc:
        state.metrics.observe_request(status=exc.status, error_type=exc.type, error_code=exc.code)
        return error_response(exc, response_id)

    # A client's `traceparent` makes the request's spans part of the client's trace.
    run = Inflight(state, plan, trace_parent=extract_trace(request.headers), api_key=api_key)
    streaming = False
    try:
        run.watch_disconnect(request.receive)
        await run.submit()
        if plan.stream:
            first = await run.next_update()
            await run.stop_watching()
            streaming = True
            return SSEResponse(
                stream_parts(run, first),
                on_close=lambda: run.close(client_gone=True),
                headers={REQUEST_ID_HEADER: response_id},
            )
        await run.run_to_end()
        body = _final_body(run)
        run.close()
        return json_response(body, headers={REQUEST_ID_HEADER: response_id})
    except ApiError as exc:
        run.close(exc)
        return error_response(exc, response_id)
    except ClientDisconnected:
        run.close(client_gone=True)
        return Response(status_code=499, headers={REQUEST_ID_HEADER: response_id})  # unread
    finally:
        if not streaming:
            run.close(client_gone=True)  # cancelled: the server is stopping or the client left


def priority_of(requested: int | None, api_key: ApiKey | None) -> int:
    """What the body asked (0 if nothing), capped by the key's class: a key may lower its
    requests' priority, never raise it past its class (which it gets when it asks none)."""
    if api_key is None:
        return requested or 0
    cap = api_key.priority_value
    return cap if requested is None else min(requested, cap)


def _plan(state: GatewayState, endpoint: Endpoint, response_id: str, raw: bytes) -> GenerationPlan:
    common: dict[str, Any] = {
        "response_id": response_id,
        "gateway_id": state.gateway_id,
        "served_model": state.settings.served_model_name,
        "arrival_time": time.time(),
        "limits": state.settings.limits,
    }
    if endpoint == "chat":
        reasoning = state.settings.reasoning_parser
        return plan_chat(
            parse_body(ChatCompletionRequest, raw), **common, reasoning_parser=reasoning
        )
    if endpoint == "completion":
        return plan_completion(parse_body(CompletionRequest, raw), **common)
    return plan_generate(parse_body(GenerateRequest, raw), **common)


def _check_aborted(plan: GenerationPlan, update: ChoiceUpdate) -> None:
    # `/generate` reports an abort as SGLang does (finish_reason type "abort"); OpenAI
    # has no finish reason for it, so those endpoints answer with an error.
    finish = update.choice.finish
    if plan.endpoint != "generate" and finish is not None and finish.kind == "abort":
        raise abort_error(update.choice)


def _final_body(run: Inflight) -> Any:
    plan, assembly = run.plan, run.assembly
    aborted = assembly.aborted()
    if plan.endpoint != "generate" and aborted is not None:
        raise abort_error(aborted)
    created = int(time.time())
    if plan.endpoint == "chat":
        return chat_completion(plan, assembly, created)
    if plan.endpoint == "completion":
        return completion(plan, assembly, created)
    return generate_result(plan, assembly, run.elapsed())


async def stream_parts(run: Inflight, first: ChoiceUpdate) -> AsyncIterator[bytes]:
    """The answer's SSE events as the parts of the response body: the events of an
    update and of every one already there behind it make one part, then it waits for the
    next. The last part ends with [DONE], after the usage chunk (or an error event)."""
    streamer = make_streamer(run.plan, run.assembly, int(time.time()))
    events: list[bytes] = []  # built, not sent yet
    try:
        update: ChoiceUpdate | None = first
        while True:
            if update is None:
                if events:
                    yield b"".join(events)
                    events.clear()
                update = await run.next_update()
            _check_aborted(run.plan, update)
            events += streamer.events(update, run.elapsed())
            if run.assembly.done:
                break
            update = run.ready_update()
        events += streamer.final(run.assembly)
        run.close()
        yield b"".join([*events, SSE_DONE])
    except ApiError as exc:
        run.close(exc)
        yield b"".join([*events, sse(exc.body()), SSE_DONE])
    finally:
        run.close(client_gone=True)  # a no-op unless the stream was cut short
