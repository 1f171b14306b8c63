"""The OpenAI error body and the one exception type the HTTP layer turns into it.

    raise ApiError.invalid("must be >= 0", param="temperature")
    body = exc.body()      # {"error": {"message", "type", "param", "code"}}

A pydantic `ValidationError` becomes a 400 with `param` naming the field the way
OpenAI does (`messages[0].content`), and a `RequestError` from the bus keeps the
status, code, param and retry hint its sender chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from radixserve.protocol import REQUEST_TOO_LARGE, RequestError

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# pydantic names union branches in an error's location ("str", "list[constrained-int]",
# "function-after[...]"); they are not fields of the body, so `param` leaves them out.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "nullable"})


# NOTE: not frozen: the interpreter and anyio set `__traceback__` / `__context__` on
# exceptions as they travel, which a frozen dataclass refuses.
@dataclass(eq=False)
class ApiError(Exception):
    """An HTTP error answer: status, OpenAI error fields and an optional retry hint."""

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    # -- the common cases ----------------------------------------------------------
    @classmethod
    def invalid(cls, message: str, param: str | None, code: str | None = None) -> ApiError:
        """400 for a parameter the client got wrong."""
        return cls(400, message, INVALID_REQUEST, param, code or INVALID_REQUEST)

    @classmethod
    def model_not_found(cls, model: str) -> ApiError:
        return cls(
            404,
            f"The model {model!r} does not exist",
            INVALID_REQUEST,
            "model",
            "model_not_found",
        )

    @classmethod
    def too_large(cls, message: str) -> ApiError:
        """413: the request is larger than the services can pass along."""
        return cls(413, message, INVALID_REQUEST, None, REQUEST_TOO_LARGE)

    @classmethod
    def unavailable(
        cls, message: str, code: str = "service_unavailable", retry_after_s: float | None = 1.0
    ) -> ApiError:
        return cls(503, message, SERVER_ERROR, None, code, retry_after_s)

    @classmethod
    def timeout(cls, timeout_s: float) -> ApiError:
        return cls(
            504,
            f"the request did not finish within {timeout_s:g} s",
            SERVER_ERROR,
            None,
            "timeout",
        )

    @classmethod
    def from_request_error(cls, err: RequestError) -> ApiError:
        return cls(
            err.http_status,
            err.message,
            err.error_type,
            err.param,
            err.code,
            err.retry_after_s,
        )

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> ApiError:
        """The most telling of pydantic's errors, as a 400 naming its parameter."""
        errors = exc.errors(include_url=False, include_input=False)
        if not errors:
            return cls.invalid("invalid request body", None)
        first = errors[0]
        if first["type"] == "json_invalid":
            return cls.invalid(f"the request body is not valid JSON: {first['msg']}", None)
        if not first["loc"]:
            return cls.invalid(f"the request body must be a JSON object: {first['msg']}", None)
        best = _most_specific(errors)
        path, tag = _split_at_branch(best["loc"])
        param = param_from_loc(path)
        if tag is not None:
            same_union = [e for e in errors if _split_at_branch(e["loc"])[0] == path]
            branches = list(dict.fromkeys(_split_at_branch(e["loc"])[1] for e in same_union))
            if len(branches) > 1 and all(e["type"].endswith("_type") for e in same_union):
                # Every branch of a union refused the value's type: say what it may be.
                expected = ", ".join(str(b).replace("constrained-", "") for b in branches)
                return cls.invalid(f"{param}: wrong type, expected one of: {expected}", param)
        full = param_from_loc(best["loc"])
        return cls.invalid(f"{full}: {best['msg']}", full)

    # -- the answer ------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(retry_after_header(self.retry_after_s))}


def error_body(
    message: str, type_: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def retry_after_header(seconds: float) -> int:
    """Retry-After takes whole seconds: round up, and never say 0 (retry at once)."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


def param_from_loc(loc: tuple[int | str, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; union branch tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_field_name(part):
            out += f".{part}" if out else part
    return out


def _is_field_name(part: str) -> bool:
    # Body fields are snake_case; branch tags have brackets/dashes or a class name.
    return part not in _TYPE_TAGS and not part[:1].isupper() and not any(c in part for c in "[]-")


def _split_at_branch(loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], str | None]:
    """(the location up to the first union branch tag, that tag or None)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and not _is_field_name(part):
            return loc[:i], part
    return loc, None


def _most_specific(errors: list[Any]) -> Any:
    """Prefer a value error over a type error (it names what was wrong with a value the
    right shape), then the deepest location (the branch that matched the most)."""

    def rank(err: Any) -> tuple[int, int]:
        return (0 if err["type"].endswith("_type") else 1, len(err["loc"]))

    return max(errors, key=rank)
