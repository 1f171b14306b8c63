"""Raw HTTP body bytes -> a validated request model, or an `ApiError` 400 with `param`."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from radixserve.api.errors import ApiError

M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """Parse and validate in one pass (pydantic's JSON parser: no dict in between)."""
    if not raw.strip():
        raise ApiError.invalid("the request body is empty: send a JSON object", None)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError.from_validation_error(exc) from None
