"""The gateway's JSON answers and OpenAI error answers, with their X-Request-Id."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from radixserve.api import ApiError

REQUEST_ID_HEADER = "X-Request-Id"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # msgspec: fast, and it writes a float that is not finite as null rather than failing.
    return Response(
        msgspec.json.encode(body), status, headers=headers, media_type="application/json"
    )


def error_response(exc: ApiError, request_id: str) -> Response:
    return json_response(exc.body(), exc.status, {**exc.headers(), REQUEST_ID_HEADER: request_id})
