"""A request's sampling parameters: SGLang's field names and defaults, with range checks.

`SamplingParams.from_dict` turns a JSON object (`sampling_params` of `/generate`, or the
protocol's msgspec struct as a dict) into the dataclass; `validate(vocab_size)` is the one
place that rejects out-of-range values. Both raise `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# Below this temperature dividing the logits can overflow float32; SGLang treats it as greedy too.
GREEDY_TEMPERATURE = 1e-6
MAX_TOP_LOGPROBS = 20
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: the prompt tokens' logprobs too, from this position on (SGLang's
    # field; -1: none). Those tokens are computed, not read from the radix cache.
    logprob_start_len: int = -1
    # Structured outputs (at most one): compiled by the grammar service or, in-process,
    # by the engine itself. `structural_tag` is SGLang's (a JSON object as text).
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # OpenAI's: token id -> a value in [-100, 100] added to its logit before sampling
    # (after the penalties); JSON gives the ids as strings.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # `stop` may be a bare string (OpenAI and SGLang accept both); store a list.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", list(self.stop))
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", _bias_by_id(self.logit_bias))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like mapping. Unknown keys raise; a null value means the default."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(values).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in _DEFAULTS:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if value is None and _DEFAULTS[key] is not None:
                continue  # JSON clients send null for "not set"
            kwargs[key] = value
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        """Repetition, frequency or presence penalty: the output so far changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError, naming the field, for any value out of range."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive (got {vocab_size})")
        self._validate_types()
        _check(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}]",
            self.min_new_tokens,
        )
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            "must be in (0, 2]",
            self.repetition_penalty,
        )
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        bad_ids = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        _check(not bad_ids, "stop_token_ids", f"must be in [0, {vocab_size})", bad_ids)
        _check(
            0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS,
            "top_logprobs_num",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
            self.top_logprobs_num,
        )
        _check(
            self.logprob_start_len >= -1,
            "logprob_start_len",
            "must be -1 (no prompt logprobs) or >= 0",
            self.logprob_start_len,
        )
        if self.logit_bias:
            bad_ids = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            _check(not bad_ids, "logit_bias", f"ids must be in [0, {vocab_size})", bad_ids)
            bad = [v for v in self.logit_bias.values() if not -100 <= v <= 100]
            _check(not bad, "logit_bias", "values must be in [-100, 100]", bad)
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        _check(
            len(grammars) <= 1,
            grammars[-1] if grammars else "regex",
            "at most one of regex / json_schema / ebnf / structural_tag may be set",
            grammars,
        )

    def _validate_types(self) -> None:
        for name, has_type, expected in _TYPE_CHECKS:
            value = getattr(self, name)
            if not has_type(value):
                raise ValueError(
                    f"sampling parameter {name!r} must be {expected}, "
                    f"got {type(value).__name__} ({value!r})"
                )


def resolve_seed(params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The request's seed: its own, or one drawn now, when the request is created.

    Drawn from torch's generator (the global one unless given), so an engine started with
    a fixed `random_seed` replays unseeded requests the same way for the same arrival order.
    """
    if params.seed is not None:
        return params.seed
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


# Each field's default, by name: built once (parameters are read per request, and
# dataclasses.fields is slow).
_DEFAULTS: dict[str, Any] = {f.name: _default_of(f) for f in dataclasses.fields(SamplingParams)}


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name!r} {rule} (got {value!r})")


# What each field must hold: "int", "float" (an int is fine), "bool", "str?" (str or None),
# "int?", "list[str]", "list[int]". bool is never accepted as a number.
_EXPECTED_TYPES: dict[str, str] = {
    "max_new_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "frequency_penalty": "float",
    "presence_penalty": "float",
    "repetition_penalty": "float",
    "stop": "list[str]",
    "stop_token_ids": "list[int]",
    "ignore_eos": "bool",
    "min_new_tokens": "int",
    "n": "int",
    "seed": "int?",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "return_logprob": "bool",
    "top_logprobs_num": "int",
    "logprob_start_len": "int",
    "regex": "str?",
    "json_schema": "str?",
    "ebnf": "str?",
    "structural_tag": "str?",
    "logit_bias": "bias?",
}


def _bias_by_id(bias: Mapping[Any, Any]) -> dict[int, float]:
    """`logit_bias` with int keys (JSON's are strings of ids); values left for validate."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if _is_int(key):
            out[key] = value
        elif isinstance(key, str) and key.strip().lstrip("-").isdigit():
            out[int(key)] = value
        else:
            raise ValueError(f"sampling parameter 'logit_bias' keys must be token ids, got {key!r}")
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    # NaN and inf compare false against every range, so reject them here.
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _is_bias(value: object) -> bool:
    return isinstance(value, dict) and all(
        _is_int(k) and _is_finite_number(v) for k, v in value.items()
    )


_CHECKERS: dict[str, Callable[[object], bool]] = {
    "int": _is_int,
    "float": _is_finite_number,
    "bool": lambda value: isinstance(value, bool),
    "str": lambda value: isinstance(value, str),
    "list[str]": _is_str_list,
    "list[int]": _is_int_list,
    "bias": _is_bias,
}


def _type_check(expected: str) -> Callable[[object], bool]:
    if expected.endswith("?"):
        check = _CHECKERS[expected[:-1]]
        return lambda value: value is None or check(value)
    return _CHECKERS[expected]


# (field, its check, what it must be), in field order: built once.
_TYPE_CHECKS = tuple(
    (name, _type_check(expected), expected) for name, expected in _EXPECTED_TYPES.items()
)
