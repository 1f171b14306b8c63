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
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.api import (
    SSE_DONE,
    ApiError,
    Assembly,
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
from radixserve.services.gateway.resume import (
    LAST_EVENT_ID_HEADER,
    Replay,
    ResumePoint,
    asked_resumable,
    claim_request_id,
    owned_record,
    plan_of,
    resumable_plan,
    tag_last,
)
from radixserve.services.gateway.state import GatewayState
from radixserve.store.output_log import OutputLog


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
    if LAST_EVENT_ID_HEADER in request.headers:  # a client resuming a stream it lost
        return await handle_resume(state, request, None)
    response_id = new_response_id(endpoint)
    try:
        state.check_accepting()
        # Streams are resumable unless the client says `X-Resumable: false`; other
        # requests when it says true (and may name them, to fetch the answer later).
        asked = asked_resumable(request.headers) if state.settings.resume_grace_s > 0 else False
        if asked and (named := request.headers.get(REQUEST_ID_HEADER)):
            response_id = await claim_request_id(state.records, named)
        plan = _plan(state, endpoint, response_id, await _bounded_body(state, request))
        api_key = api_key_of(request.scope)
        plan = with_priority(plan, priority_of(plan.requested_priority, api_key))
        resumable = asked if asked is not None else plan.stream
        if resumable:
            plan = resumable_plan(plan)
    except ApiError as exc:
        state.metrics.observe_request(status=exc.status, error_type=exc.type, error_code=exc.code)
        return error_response(exc, response_id)

    # A client's `traceparent` makes the request's spans part of the client's trace.
    run = Inflight(
        state,
        plan,
        trace_parent=extract_trace(request.headers),
        api_key=api_key,
        resumable=resumable,
    )
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
                on_close=run.client_left,
                headers={REQUEST_ID_HEADER: response_id},
            )
        await run.run_to_end()
        body = final_body(run.plan, run.assembly, run.created, run.elapsed())
        run.close()
        return json_response(body, headers={REQUEST_ID_HEADER: response_id})
    except ApiError as exc:
        run.close(exc)
        return error_response(exc, response_id)
    except ClientDisconnected:
        run.client_left()
        return Response(status_code=499, headers={REQUEST_ID_HEADER: response_id})  # unread
    finally:
        if not streaming:
            run.client_left()  # cancelled: the server is stopping or the client left


async def handle_resume(state: GatewayState, request: Request, rid: str | None) -> Response:
    """A resumable request's answer for a client that lost it, from its Last-Event-ID
    (`rid` from the path of `GET /v1/requests/{rid}/output`; else the id names it)."""
    event_id = request.headers.get(LAST_EVENT_ID_HEADER)
    response_id = rid or uuid.uuid4().hex
    try:
        point = ResumePoint.parse(event_id) if event_id else None
        if point is None:
            if rid is None:
                raise ApiError.invalid("Last-Event-ID is empty", "Last-Event-ID")
        elif rid is not None and point.response_id != rid:
            raise ApiError.invalid(f"Last-Event-ID is not an event of {rid}", "Last-Event-ID")
        response_id = point.response_id if rid is None and point is not None else response_id
        record = await owned_record(state.records, response_id, api_key_of(request.scope))
        plan, created = plan_of(record)
        offsets = point.offsets if point is not None else (0,) * len(plan.rids)

        async def record_now() -> Mapping[str, Any] | None:
            try:
                return await state.records.get(response_id)
            except Exception:  # the log's own end or the deadline decide then
                return None

        replay = Replay(
            OutputLog(state.records.store),
            plan,
            ResumePoint(response_id, offsets),
            created,
            received_at=float(record.get("received_at", time.time())),
            timeout_s=state.settings.request_timeout_s,
            record_state=record_now,
        )
        state.records.update(response_id, {"resumed_at": time.time()})
        headers = {REQUEST_ID_HEADER: response_id}
        if plan.stream:
            first = await replay.next_update()
            return SSEResponse(stream_parts(replay, first), replay.client_left, headers)
        while not replay.assembly.done:
            await replay.next_update()
        body = final_body(plan, replay.assembly, created, replay.elapsed())
        return json_response(body, headers=headers)
    except ApiError as exc:
        return error_response(exc, response_id)


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


def final_body(plan: GenerationPlan, assembly: Assembly, created: int, elapsed_s: float) -> Any:
    aborted = assembly.aborted()
    if plan.endpoint != "generate" and aborted is not None:
        raise abort_error(aborted)
    if plan.endpoint == "chat":
        return chat_completion(plan, assembly, created)
    if plan.endpoint == "completion":
        return completion(plan, assembly, created)
    return generate_result(plan, assembly, elapsed_s)


class StreamRun(Protocol):
    """What a stream is read from: the request's own run (gateway/inflight.py) or a
    resumed one's replay (gateway/resume.py)."""

    plan: GenerationPlan
    assembly: Assembly
    created: int
    resumable: bool  # its events carry ids
    replaying: bool  # the last update is one the client has: built, not sent

    def elapsed(self) -> float: ...
    def event_id(self) -> bytes: ...
    async def next_update(self) -> ChoiceUpdate: ...
    def ready_update(self) -> ChoiceUpdate | None: ...
    def close(self, error: ApiError | None = None, *, client_gone: bool = False) -> None: ...
    def client_left(self) -> None: ...


async def stream_parts(run: StreamRun, first: ChoiceUpdate) -> AsyncIterator[bytes]:
    """The answer's SSE events as the parts of the response body: the events of an
    update and of every one already there behind it make one part, then it waits for the
    next. The last part ends with [DONE], after the usage chunk (or an error event)."""
    streamer = make_streamer(run.plan, run.assembly, run.created)
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
            built = streamer.events(update, run.elapsed())
            if not run.replaying:
                start = len(events)
                events += built
                if run.resumable:
                    tag_last(events, start, run.event_id())
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
        run.client_left()  # a no-op unless the stream was cut short
