"""Stop strings in output text: what to hold back while streaming, where to cut at the end.

OpenAI behaviour: the stop string that ended a request, and anything after it, is
not returned (unless `no_stop_trim`). While a request runs, a tail of the text that
could still grow into a stop string is held back, so a stop string that arrives
split over two steps never leaks to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class FinishLike(Protocol):
    """A finish reason: the engine's dataclass and the protocol's message both fit."""

    @property
    def kind(self) -> str: ...

    @property
    def matched(self) -> int | str | None: ...


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the start of (or a whole) stop string.

    That tail must wait: the next tokens may complete the stop string, and then it
    is trimmed instead of sent.
    """
    longest = 0
    for stop in stops:
        for size in range(min(len(stop), len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def trim_stop_string(text: str, reason: FinishLike | None, no_stop_trim: bool) -> str:
    """The output text ends before the stop string that finished it."""
    if reason is None or no_stop_trim or reason.kind != "stop":
        return text
    matched = reason.matched
    if not isinstance(matched, str) or not matched:
        return text
    cut = text.find(matched)
    return text if cut < 0 else text[:cut]


def trims_stop_token(ids: Sequence[int], reason: FinishLike | None, no_stop_trim: bool) -> bool:
    """True when the last id is the stop token that ended the request and leaves the text.

    As SGLang: a matched stop token is not part of the text (it matters with
    `skip_special_tokens=False` or a non-special `stop_token_ids` entry).
    """
    if reason is None or no_stop_trim or reason.kind != "stop" or not ids:
        return False
    matched = reason.matched
    return isinstance(matched, int) and not isinstance(matched, bool) and ids[-1] == matched
