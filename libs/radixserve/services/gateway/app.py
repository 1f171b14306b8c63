"""The ASGI app of one gateway: routes, OpenAI error bodies, X-Request-Id.

    app = create_app(state)     # state: GatewayState (bus, hub, records, metrics, ...)

Bodies are parsed by `radixserve.api.parse_body` (pydantic, strict) rather than by
FastAPI's parameter injection, so every validation error is the OpenAI 400 with
`param`; FastAPI's own 422 and Starlette's HTTP errors are rewritten in that shape too.

A POST to a generation endpoint (`GENERATION_PATHS`) is served ahead of FastAPI
(`GenerationRoutes`): it skips FastAPI's routing and middleware, which a streamed
answer would otherwise pass each of its parts through (four calls a token). The
answers are the same: `handle_generation` puts X-Request-Id on each of them, and a
failure it did not expect gets the 500 that FastAPI's handler gives. The same paths
are FastAPI routes too, for every other method (405) and the OpenAPI schema.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.api import ApiError, Endpoint
from radixserve.api.errors import INVALID_REQUEST, SERVER_ERROR, error_body, param_from_loc
from radixserve.bus import BusError, BusNoResponders, BusTimeout
from radixserve.protocol import FlushCacheReply, FlushCacheRequest, ProtocolError, decode, encode
from radixserve.services.gateway.auth import AuthGate, api_key_of
from radixserve.services.gateway.generation import handle_generation, handle_resume
from radixserve.services.gateway.responses import REQUEST_ID_HEADER, error_response, json_response
from radixserve.services.gateway.resume import REQUEST_ID, owned_record
from radixserve.services.gateway.state import GatewayState
from radixserve.telemetry.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

GENERATION_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/generate": "generate",
}


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the handler's (the response id) if it set
    one, else a fresh one. Pure ASGI, so streamed bodies pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", uuid.uuid4().hex.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class GenerationRoutes:
    """POST to a generation path -> `handle_generation`, before `app` (FastAPI) sees it;
    any other request -> `app`."""

    def __init__(self, state: GatewayState, app: ASGIApp) -> None:
        self.state = state
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = GENERATION_PATHS.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handle_generation(self.state, request, endpoint)
        except Exception as exc:
            response = internal_error(request, exc)
            response.headers[REQUEST_ID_HEADER] = uuid.uuid4().hex
        await response(scope, receive, send)


def internal_error(request: Request, exc: Exception) -> Response:
    """The 500 of a failure no handler expected (logged with its traceback)."""
    log.error("unhandled error on %s: %r", request.url.path, exc, exc_info=exc)
    return json_response(error_body("internal server error", SERVER_ERROR, None, None), 500)


def _generation(
    state: GatewayState, endpoint: Endpoint
) -> Callable[[Request], Awaitable[Response]]:
    async def generation(request: Request) -> Response:
        return await handle_generation(state, request, endpoint)

    return generation


def create_app(state: GatewayState) -> ASGIApp:
    app = FastAPI(title="radixserve gateway", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIdMiddleware)
    _add_error_handlers(app)
    settings = state.settings

    for path, endpoint in GENERATION_PATHS.items():
        app.add_api_route(path, _generation(state, endpoint), methods=["POST"], name=endpoint)

    def model_card() -> dict[str, object]:
        return {
            "id": settings.served_model_name,
            "object": "model",
            "created": state.started_at,
            "owned_by": "radixserve",
        }

    def not_serving() -> ApiError | None:
        """The 503 of a model that no ready worker serves yet (clients and benchmark tools
        wait on /v1/models before they send)."""
        missing = state.missing()
        if not missing:
            return None
        return ApiError.unavailable(
            f"the model is not ready to serve yet (waiting for: {', '.join(missing)})",
            code="not_ready",
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        if (unavailable := not_serving()) is not None:
            return error_response(unavailable, uuid.uuid4().hex)
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        if model != settings.served_model_name:
            return error_response(ApiError.model_not_found(model), uuid.uuid4().hex)
        if (unavailable := not_serving()) is not None:
            return error_response(unavailable, uuid.uuid4().hex)
        return json_response(model_card())

    @app.get("/health/live")
    async def live() -> Response:
        # The process answers: restart it only when this fails (draining is alive).
        return json_response({"status": "alive"})

    @app.get("/health/ready")
    async def ready() -> Response:
        missing = state.missing()
        if missing:
            return json_response({"status": "not_ready", "missing": missing}, 503)
        return json_response({"status": "ready"})

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return json_response({"status": "draining"}, 503)
        if not state.bus.is_connected:
            return json_response({"status": "no_bus", "workers_ready": 0}, 503)
        state.workers.prune()
        missing = state.missing()
        body = {
            "status": "not_ready" if missing else "ok",
            "workers_ready": state.workers.ready_count(),
            "services": state.workers.services(),
            "missing": missing,
        }
        return json_response(body, 503 if missing else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.workers.prune()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        rid = uuid.uuid4().hex
        headers = {REQUEST_ID_HEADER: rid}
        try:
            state.check_accepting()
            with state.metrics.common.time_nats("flush_cache"):
                msg = await state.bus.request(
                    state.subjects.flush_cache,
                    encode(FlushCacheRequest(rid=rid)),
                    timeout_s=settings.flush_timeout_s,
                )
            reply = decode(msg.data, FlushCacheReply)
        except ApiError as exc:
            return error_response(exc, rid)
        except BusNoResponders:
            return error_response(ApiError.unavailable("no scheduler answers", "no_scheduler"), rid)
        except BusTimeout:
            return error_response(ApiError.timeout(settings.flush_timeout_s), rid)
        except (BusError, ProtocolError) as exc:
            return error_response(ApiError.unavailable(f"flush failed: {exc}"), rid)
        # As SGLang: 200 when every cache was emptied, 400 when not (requests running).
        return json_response(
            {"ok": reply.ok, "message": reply.message}, 200 if reply.ok else 400, headers
        )

    @app.get("/v1/requests/{rid}")
    async def get_request_record(rid: str, request: Request) -> Response:
        try:
            record = await owned_record(state.records, rid, api_key_of(request.scope))
        except ApiError as exc:
            return error_response(exc, rid if REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex)
        record.pop("plan", None)  # how to rebuild the answer: not the caller's business
        return json_response(record, headers={REQUEST_ID_HEADER: rid})

    @app.get("/v1/requests/{rid}/output")
    async def get_request_output(rid: str, request: Request) -> Response:
        # The answer of a resumable request, from the client's Last-Event-ID on.
        return await handle_resume(state, request, rid)

    routes = GenerationRoutes(state, app)
    if state.guard is None:
        return routes
    return AuthGate(routes, state.guard, frozenset(GENERATION_PATHS), state.metrics)


def _add_error_handlers(app: FastAPI) -> None:
    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = tuple(first.get("loc", ()))
        # FastAPI prefixes where the value came from ("body", "path", "query").
        param = param_from_loc(loc[1:]) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return json_response(error_body(message, INVALID_REQUEST, param, INVALID_REQUEST), 400)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else None
        error_type = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return json_response(
            error_body(str(exc.detail), error_type, None, code),
            exc.status_code,
            dict(exc.headers or {}),
        )

    async def unexpected_error(request: Request, exc: Exception) -> Response:
        return internal_error(request, exc)

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)
