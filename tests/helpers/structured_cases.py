"""Grammars for the structured-output tests: 20 JSON schemas of increasing difficulty,
8 regexes, an arithmetic EBNF, and the checks that tell a valid output.

Every grammar bounds its output (string lengths, array sizes, number ranges, fixed
separators): a random-weight model, which only the constraint keeps on track, must
still finish within the token budget.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

# A tool's parameters (and a response_format schema) in the stack and compose tests.
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}

_NAME = {"type": "string", "maxLength": 12}
_SMALL_INT = {"type": "integer", "minimum": -50, "maximum": 50}

JSON_SCHEMAS: list[dict[str, Any]] = [
    # 1-3: scalars and one field
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    # 4-5: required and optional fields
    {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"name": _NAME, "nickname": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    },
    # 6: arrays with min/max items
    {"type": "array", "items": _SMALL_INT, "minItems": 2, "maxItems": 4},
    # 7: enum and const
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "banned"]},
            "version": {"const": 2},
        },
        "required": ["status", "version"],
    },
    # 8: numbers with bounds
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "discount": {"type": "number", "minimum": -1.5, "maximum": 1.5},
        },
        "required": ["price", "discount"],
    },
    # 9: pattern
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["code", "zip"],
    },
    # 10: a nested object
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": _NAME,
                },
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    # 11: an array of objects
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
            "required": ["x", "y"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    # 12: anyOf
    {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "maxLength": 5},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
    },
    # 13: $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    # 14: nested arrays
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    # 15: an enum of mixed types
    {
        "type": "object",
        "properties": {"level": {"enum": [1, "two", None, True]}},
        "required": ["level"],
    },
    # 16: a type union
    {
        "type": "object",
        "properties": {
            "count": {"type": ["integer", "null"], "minimum": 0, "maximum": 10},
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["count", "label"],
    },
    # 17: many optional fields, one required
    {
        "type": "object",
        "properties": {
            "a": {"type": "boolean"},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
            "c": {"type": "string", "maxLength": 4},
            "d": {"type": "null"},
            "e": {"enum": ["x", "y"]},
        },
        "required": ["c"],
    },
    # 18: $ref inside an array
    {
        "$defs": {
            "tag": {
                "type": "object",
                "properties": {
                    "key": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "on": {"type": "boolean"},
                },
                "required": ["key", "on"],
            }
        },
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"$ref": "#/$defs/tag"},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    # 19: a deep document
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "street": {"type": "string", "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["street", "zip"],
                    },
                },
                "required": ["name", "address"],
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["id", "customer", "items"],
    },
    # 20: anyOf of tagged objects, through $ref, in an array
    {
        "$defs": {
            "circle": {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "r": {"type": "number", "minimum": 0, "maximum": 10},
                },
                "required": ["kind", "r"],
            },
            "rect": {
                "type": "object",
                "properties": {
                    "kind": {"const": "rect"},
                    "w": {"type": "integer", "minimum": 1, "maximum": 20},
                    "h": {"type": "integer", "minimum": 1, "maximum": 20},
                },
                "required": ["kind", "w", "h"],
            },
        },
        "type": "object",
        "properties": {
            "shapes": {
                "type": "array",
                "items": {"anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/rect"}]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["shapes"],
    },
]

REGEXES: dict[str, str] = {
    "email": r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)",
    "iso_date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "hex_colour": r"#[0-9a-fA-F]{6}",
    "ipv4": r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    "log_line": r"\[(INFO|WARN|ERROR)\] [a-z]{1,8}: [a-z ]{1,20}",
    "signed_decimal": r"[+-]?\d{1,5}(\.\d{1,3})?",
    "greeting": r"Hello, world!",
}

# Arithmetic over positive integers, at most three operands and one level of parentheses.
ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= " + " | " - " | " * " | " / "
num ::= [1-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""

# A schema whose keys are long and fixed: what jump-forward skips the decoding of.
LONG_KEYS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer_full_legal_name_as_registered": {"type": "string", "maxLength": 12},
        "customer_primary_shipping_address_line": {"type": "string", "maxLength": 12},
        "preferred_delivery_time_window_in_hours": {"type": "integer", "minimum": 0, "maximum": 24},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
        "number_of_previous_orders_in_last_year": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": [
        "customer_full_legal_name_as_registered",
        "customer_primary_shipping_address_line",
        "preferred_delivery_time_window_in_hours",
        "has_accepted_the_terms_and_conditions",
        "number_of_previous_orders_in_last_year",
    ],
}


def check_json(text: str, schema: dict[str, Any]) -> Any:
    """The parsed value; AssertionError (with the text) unless it parses and validates."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON ({exc}): {text!r}") from exc
    jsonschema.validate(value, schema)
    return value


def check_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"


def check_arithmetic(text: str) -> float:
    """Parses as an arithmetic expression of integers (and evaluates it)."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    for node in ast.walk(tree):
        assert isinstance(node, allowed), f"{text!r}: unexpected {type(node).__name__}"
    return float(eval(compile(tree, "<expr>", "eval")))
