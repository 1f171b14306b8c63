"""The per-request bounds of the HTTP API: what they are, and how the gateway is told them.

    add_limit_arguments(parser)                  # --max-stop-strings, --max-grammar-bytes, ...
    limits = limits_from(parser.parse_args())    # flag, else $RADIXSERVE_MAX_<THING>, else default
    plan = plan_chat(body, ..., limits=limits)   # a value past a bound: 400 naming its param

Each bound keeps one request from costing what many should (a KV pool of choices, a
grammar that compiles for seconds, a prompt of tool schemas) and sits well above what
real clients send. `bounds` checks them; the engine's context length still bounds
prompt + max_tokens later (the tokenizer checks that).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

ENV_PREFIX = "RADIXSERVE_"


def _bound(default: int, what: str) -> int:
    # The help text rides on the field, so the flag, the variable and --help name one thing.
    return field(default=default, metadata={"help": what})


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask for; every bound is an integer >= 1."""

    max_n: int = _bound(128, "choices per prompt (n)")
    max_output_tokens: int = _bound(
        128 * 1024,
        "tokens one choice may generate (max_tokens, max_completion_tokens, max_new_tokens)",
    )
    max_prompts: int = _bound(1024, "prompts in one /v1/completions list or /generate batch")
    max_messages: int = _bound(2048, "messages in one chat request")
    max_stop_strings: int = _bound(16, "stop strings of one request")
    max_stop_string_chars: int = _bound(256, "characters of one stop string")
    max_stop_token_ids: int = _bound(256, "stop_token_ids of one request")
    max_logit_bias: int = _bound(1024, "logit_bias entries of one request")
    max_tools: int = _bound(128, "tools of one chat request")
    max_tool_schema_bytes: int = _bound(
        32 * 1024, "bytes of one tool's parameters schema (compact JSON)"
    )
    max_tools_bytes: int = _bound(256 * 1024, "bytes of all the tools together (compact JSON)")
    max_grammar_bytes: int = _bound(
        64 * 1024,
        "bytes of one grammar (regex, json_schema, ebnf, structural_tag, response_format, "
        "or the schema a required or named tool_choice makes)",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


# What a server that configures nothing allows.
DEFAULT_LIMITS = RequestLimits()


def flag_of(name: str) -> str:
    """`max_stop_strings` -> `--max-stop-strings`."""
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    """`max_stop_strings` -> `RADIXSERVE_MAX_STOP_STRINGS`."""
    return ENV_PREFIX + name.upper()


def configured_by(name: str) -> str:
    """How an operator changes one bound, for the error a client gets past it."""
    return f"set by the server's {flag_of(name)} or ${env_of(name)}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (a request past one gets a 400)")
    for f in fields(RequestLimits):
        group.add_argument(
            flag_of(f.name),
            dest=f.name,
            type=_positive_int,
            default=None,
            help=f"most {f.metadata['help']}; default ${env_of(f.name)} or {f.default}",
        )


def limits_from(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RequestLimits:
    """Each bound from its flag, else its variable, else the default. A variable that is
    not an integer >= 1 is a ValueError naming it (an unset or blank one is the default)."""
    env = os.environ if environ is None else environ
    values: dict[str, int] = {}
    for f in fields(RequestLimits):
        flag = getattr(ns, f.name, None)
        if flag is not None:
            values[f.name] = flag
            continue
        text = env.get(env_of(f.name), "").strip()
        if text:
            try:
                values[f.name] = _positive_int(text)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{env_of(f.name)}: {exc}") from None
    return RequestLimits(**values)
