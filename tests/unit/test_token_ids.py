"""checked_token_ids: what the engine accepts as a prompt's ids, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.engine.token_ids import checked_token_ids


@pytest.mark.parametrize(
    "ids",
    [[0, 5, 99], (0, 5, 99), np.array([0, 5, 99], dtype=np.int32), np.array([0, 5, 99], np.uint16)],
)
def test_integer_sequences_become_lists_of_python_ints(ids: object) -> None:
    out = checked_token_ids(ids, vocab_size=100)  # type: ignore[arg-type]
    assert out == [0, 5, 99]
    assert type(out) is list and all(type(t) is int for t in out)
    assert out is not ids  # a new list: the caller's may change later


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "empty"),
        ([1.0, 2.0], "integers"),  # floats were truncated by int() before: now refused
        ([1, 2.0], "integers"),  # a float after an int
        ([np.float64(1.0)], "integers"),
        ([True, False], "integers"),
        (["1", "2"], "integers"),
        ([[1, 2], [3, 4]], "flat"),
        ([[1, 2], [3]], "list of token ids"),
        ([2**70], "integers"),  # past int64: numpy's object dtype
        ([1, -(2**70)], "integers"),
        ([-1, 4], r"\[0, 100\)"),
        ([4, 100], r"\[0, 100\)"),
    ],
)
def test_bad_ids_are_refused_with_a_clear_error(ids: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        checked_token_ids(ids, vocab_size=100)  # type: ignore[arg-type]


def test_numpy_ints_in_a_list_and_ints_beside_bools_are_accepted() -> None:
    assert checked_token_ids([np.int64(3), np.int32(4)], vocab_size=10) == [3, 4]
    assert checked_token_ids((1, True, 2), vocab_size=10) == [1, True, 2]  # as numpy did
    assert checked_token_ids([True, 2], vocab_size=10) == [True, 2]
