"""What a constrained request asks for: the grammar's kind and its source text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from radixserve.protocol.grammar import GrammarKind

# In the order the sampling fields are checked; the kind is also the field's name.
GRAMMAR_KINDS: tuple[GrammarKind, ...] = get_args(GrammarKind)


class InvalidGrammar(ValueError):
    """The compiler refused the source: `message` is its reason, `kind` the field to blame."""

    def __init__(self, kind: GrammarKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class GrammarSource:
    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")

    @property
    def param(self) -> str:
        """The request field an error points at (the sampling field of that name)."""
        return self.kind


def grammar_source_of(get: Callable[[str], object]) -> GrammarSource | None:
    """The one grammar a set of sampling parameters carries (`get(field)`), or None.

    More than one is the caller's error to report before this point (the engine's
    `SamplingParams.validate`, the tokenizer's `grammar_spec`); the first one wins here.
    """
    for kind in GRAMMAR_KINDS:
        value = get(kind)
        if isinstance(value, str):
            return GrammarSource(kind, value)
    return None
