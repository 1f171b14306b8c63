"""The gateway's door: every request but the health probes shows a key with the scope
its path needs, and a generation request is within its key's rate limits.

    app = AuthGate(app, guard)   # guard None: auth off, everything passes

Scopes by path: /health* none (probes), /metrics `metrics`, /flush_cache `admin`, the
rest `inference` (a request record of another key also needs `admin`, checked where it
is read). A 401 carries `WWW-Authenticate: Bearer`; a 429 carries Retry-After and the
key's x-ratelimit-* headers, which an admitted generation answer carries too. The key
reaches the handlers as `request.state.api_key`.
"""

from __future__ import annotations

import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.api import ApiError
from radixserve.auth import ApiKey, presented_key
from radixserve.auth import Scope as KeyScope
from radixserve.services.gateway.responses import error_response
from radixserve.services.gateway.state import Guard
from radixserve.telemetry import GatewayMetrics

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready"})
_SCOPE_OF_PATH: dict[str, KeyScope] = {"/metrics": "metrics", "/flush_cache": "admin"}


def required_scope(path: str) -> KeyScope | None:
    if path in OPEN_PATHS:
        return None
    return _SCOPE_OF_PATH.get(path, "inference")


def forbidden(key: ApiKey, scope: str) -> ApiError:
    return ApiError(
        403,
        f"the API key {key.name!r} lacks the {scope!r} scope this needs",
        "permission_error",
        None,
        "insufficient_scope",
    )


class AuthGate:
    def __init__(
        self,
        app: ASGIApp,
        guard: Guard,
        limited_paths: frozenset[str],
        metrics: GatewayMetrics,
    ) -> None:
        self.app = app
        self.guard = guard
        self.limited_paths = limited_paths  # POSTs here count against rate limits
        self.metrics = metrics  # a refused generation request is counted as one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (needed := required_scope(scope["path"])) is None:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        generation = scope["method"] == "POST" and scope["path"] in self.limited_paths
        try:
            key = await self.guard.authenticator.check(presented_key(headers))
            if not key.has(needed):
                raise forbidden(key, needed)
            limit_headers = await self.guard.limiter.admit(key) if generation else {}
        except ApiError as exc:
            if generation:
                self.metrics.observe_request(
                    status=exc.status, error_type=exc.type, error_code=exc.code
                )
            response = error_response(exc, uuid.uuid4().hex)
            if exc.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            if exc.status != 503:  # the path as repr: a client's newline cannot forge a line
                log.info(
                    "%s %r refused: %d %s", scope["method"], scope["path"], exc.status, exc.code
                )
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = key
        if not limit_headers:
            await self.app(scope, receive, send)
            return
        extra = [(name.encode(), value.encode()) for name, value in limit_headers.items()]

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_limits)


def _headers(scope: Scope) -> dict[str, str]:
    found: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        if name in ("authorization", "x-api-key") and name not in found:
            found[name] = raw_value.decode("latin-1")
    return found


def api_key_of(scope: Scope) -> ApiKey | None:
    """The caller's key (None with auth off)."""
    key = scope.get("state", {}).get("api_key")
    return key if isinstance(key, ApiKey) else None
