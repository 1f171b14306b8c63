"""What a frontend program appends to its state: text, `gen`, `select` and chat turns.

Expressions concatenate with `+` (`"Answer: " + gen("answer")`), as in SGLang's
frontend language; the state runs them in order when they are appended (`s += ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

ROLES = ("system", "user", "assistant")


class LangError(RuntimeError):
    """A program the frontend cannot run as written, or a backend's refusal."""


class Expr:
    """Something a program appends; `+` makes a sequence of them."""

    def __add__(self, other: Item) -> Seq:
        return Seq((self, other))

    def __radd__(self, other: Item) -> Seq:
        return Seq((other, self))


Item = Union[str, Expr, "list[Item]", "tuple[Item, ...]"]


@dataclass(frozen=True)
class Seq(Expr):
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into the variable `name` (None: appended, not kept)."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


SELECT_METHODS = ("likelihood", "greedy")


@dataclass(frozen=True)
class Select(Expr):
    """Choose one of `choices`: `likelihood` (SGLang's default) scores each choice's
    tokens after the program so far by their mean logprob and takes the best;
    `greedy` decodes greedily under a grammar that admits exactly those texts."""

    name: str | None
    choices: tuple[str, ...]
    method: str = "likelihood"


@dataclass(frozen=True)
class Role(Expr):
    """A chat turn: its content rendered by the model's chat template."""

    role: str
    content: tuple[Item, ...]


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    *,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | None = None,
    choices: list[str] | None = None,
) -> Gen | Select:
    """Generate up to `max_tokens` tokens (SGLang's `gen`); parameters left at None take
    the server's defaults. `choices` makes it a `select`."""
    if choices is not None:
        return select(name, choices)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    given = {
        "stop": stop,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "seed": seed,
        "regex": regex,
        "json_schema": json_schema,
    }
    params = {"max_new_tokens": max_tokens, **{k: v for k, v in given.items() if v is not None}}
    return Gen(name, params)


def select(
    name: str | None, choices: list[str] | tuple[str, ...], method: str = "likelihood"
) -> Select:
    """One of `choices`: by default the one whose tokens have the highest mean logprob
    after the program so far (SGLang's token-length-normalised choice); `method="greedy"`:
    the one greedy decoding reaches under a grammar that admits only those texts."""
    options = tuple(choices)
    if not options or not all(isinstance(c, str) and c for c in options):
        raise ValueError("select needs one or more non-empty strings")
    if method not in SELECT_METHODS:
        raise ValueError(f"select's method must be one of {SELECT_METHODS}, got {method!r}")
    return Select(name, options, method)


def choices_regex(choices: tuple[str, ...]) -> str:
    """A regex that matches exactly one of `choices` (literal text)."""
    special = set("\\^$.|?*+()[]{}")
    escaped = ("".join("\\" + ch if ch in special else ch for ch in c) for c in choices)
    return "(" + "|".join(escaped) + ")"


def system(*content: Item) -> Role:
    return Role("system", content)


def user(*content: Item) -> Role:
    return Role("user", content)


def assistant(*content: Item) -> Role:
    return Role("assistant", content)
