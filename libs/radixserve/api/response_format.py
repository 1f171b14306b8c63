"""OpenAI's `response_format` -> the grammar the grammar hop compiles: json_object and
json_schema as a JSON schema, structural_tag as xgrammar's tag JSON."""

from __future__ import annotations

import json

from radixserve.api.errors import ApiError
from radixserve.api.openai_models import ResponseFormat

# SGLang's choice for `response_format: json_object`: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Where each `response_format` type keeps its grammar in the body.
RESPONSE_FORMAT_PARAM = {
    "json_object": "response_format",
    "json_schema": "response_format.json_schema.schema",
    "structural_tag": "response_format.structures",
}


def response_format_grammar(fmt: ResponseFormat | None) -> tuple[str, str] | None:
    """`response_format` -> (sampling field, source) the grammar hop compiles, or None."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "structural_tag":
        if not fmt.structures:
            raise ApiError.invalid(
                "response_format of type structural_tag needs structures",
                "response_format.structures",
            )
        tag = {"structures": fmt.structures, "triggers": fmt.triggers or []}
        return "structural_tag", json.dumps(tag)
    schema = response_format_schema(fmt)
    return None if schema is None else ("json_schema", schema)


def response_format_schema(fmt: ResponseFormat | None) -> str | None:
    """`response_format` json_object / json_schema -> the JSON schema source (or None)."""
    if fmt is None or fmt.type in ("text", "structural_tag"):
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError.invalid(
            "response_format of type json_schema needs json_schema.schema",
            "response_format.json_schema",
        )
    return json.dumps(fmt.json_schema.schema_)
