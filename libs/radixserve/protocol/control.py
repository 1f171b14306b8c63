"""Aborts, errors and cache control: the messages that are not the happy path."""

from __future__ import annotations

import msgspec

from radixserve.protocol.base import Message

# On a worker's acknowledgement of a run: it refuses the run (it is draining), so the
# scheduler re-routes it at once instead of failing it.
RUN_REFUSED_HEADER = "Radixserve-Refused"


class AbortRequest(Message, frozen=True):
    """Stop a request: gateway -> scheduler, then scheduler -> the worker that holds it.

    The worker answers with a final `StepOutput` whose finish reason is `abort`, so
    the gateway sees every request end the same way.
    """

    rid: str
    reason: str = ""


class RequestError(Message, frozen=True):
    """A service -> the gateway that owns the request: the request failed before finishing.

    Fields map to the OpenAI error body `{"error": {"message", "type", "param", "code"}}`;
    `http_status` is the status the gateway answers with (400, 413, 429, 503, ...).
    `service` names the sender, for logs.
    """

    rid: str
    code: str
    message: str
    http_status: int
    error_type: str = "invalid_request_error"
    param: str | None = None
    service: str = ""
    retry_after_s: float | None = None  # 429 / 503: the gateway's Retry-After header


REQUEST_TOO_LARGE = "request_too_large"


def retry_later_error(
    rid: str, code: str, message: str, service: str, retry_after_s: float = 1.0
) -> RequestError:
    """503 for a request a service could not carry on with now (draining, a peer lost or
    unreachable): the client may send it again after `retry_after_s`."""
    return RequestError(
        rid=rid,
        code=code,
        message=message,
        http_status=503,
        error_type="server_error",
        service=service,
        retry_after_s=retry_after_s,
    )


def too_large_error(rid: str, service: str, what: str) -> RequestError:
    """413 for a request that grew past the bus's payload limit on its way (`what` says
    where): sending it again cannot succeed, so no retry hint."""
    return RequestError(
        rid=rid,
        code=REQUEST_TOO_LARGE,
        message=f"the request is too large to pass {what}; send a shorter prompt",
        http_status=413,
        service=service,
    )


class InflightQuery(Message, frozen=True):
    """gateway -> scheduler, request/reply: what became of `rids`. The gateway asks about
    requests it has heard nothing of for a while: one the scheduler saw end long enough
    ago ended without its gateway hearing of it (its last output, or its error, was
    lost on the way back)."""

    rids: list[str]


class InflightReply(Message, frozen=True):
    """`inflight`: the rids still routed to a worker and unfinished; `ended`: rid -> seconds
    since it ended (finished, failed, aborted), for those the scheduler remembers. A rid
    in neither is unknown to it (not yet scheduled, or from before a restart)."""

    inflight: list[str]
    ended: dict[str, float] = msgspec.field(default_factory=dict)


class FlushCacheRequest(Message, frozen=True):
    """Empty the radix caches (`POST /flush_cache`): gateway -> scheduler -> each worker.

    `rid` identifies this flush in logs and replies.
    """

    rid: str


class FlushCacheReply(Message, frozen=True):
    """The answer to a flush; from a worker `worker_id` is set, from the scheduler it is ""."""

    rid: str
    ok: bool
    worker_id: str = ""
    message: str = ""
