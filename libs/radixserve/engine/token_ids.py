"""A prompt's token ids as the engine keeps them: a list of Python ints in the vocabulary.

One pass packs them into int64 (array.array refuses anything but integers) and numpy
checks the range: faster than numpy's own conversion or a Python loop of int() plus
min() and max() (measured: lab/notebook/2026-12-01-figures-from-code-comments.md). Offline runs submit
thousands of prompts before the first step, with the GPU idle meanwhile.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np


def checked_token_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> list[int]:
    """`ids` as a new list; ValueError unless a non-empty flat sequence of integers (not
    floats, not all bools) in [0, vocab_size). A list or tuple is copied as it is (its
    items are integers: numpy found no other dtype); an array becomes Python ints."""
    if isinstance(ids, list | tuple) and ids and type(ids[0]) is not bool:
        # The common case in ~60% of numpy's time: packing into int64 refuses floats,
        # strings, nesting and ints past int64 (which the full check below then names).
        try:
            packed = np.frombuffer(array.array("q", ids), dtype=np.int64)
        except (TypeError, OverflowError):
            pass
        else:
            _check_range(packed, vocab_size)
            return list(ids)
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:  # ragged nesting, unconvertible items
        raise ValueError(f"input_ids must be a list of token ids ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"input_ids must be a flat list of token ids, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("the prompt is empty")
    if arr.dtype.kind not in "iu":  # floats, bools, strings; object: ints past int64
        raise ValueError(f"input_ids must be integers, got {arr.dtype} values")
    _check_range(arr, vocab_size)
    if isinstance(ids, np.ndarray):
        out: list[int] = arr.tolist()
        return out
    return list(ids)  # no int() per item: numpy's pass was the check


def _check_range(arr: np.ndarray, vocab_size: int) -> None:
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"input_ids must be in [0, {vocab_size})")
