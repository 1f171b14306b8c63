"""Bounded retries with exponential backoff, shared by the NATS and Redis clients."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class RetriesExhausted(Exception):
    """Every attempt failed; `last_error` is the final attempt's exception."""

    def __init__(self, attempts: int, last_error: BaseException) -> None:
        super().__init__(f"{attempts} attempts failed; last: {last_error!r}")
        self.attempts = attempts
        self.last_error = last_error


async def retry_with_backoff(
    attempt: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    first_delay_s: float,
    max_delay_s: float,
    retry_on: tuple[type[BaseException], ...],
    log: logging.Logger,
    what: str,
) -> T:
    """Await `attempt()` up to `attempts` times, sleeping first_delay_s, doubling up to
    max_delay_s, between failures of the `retry_on` kinds; other exceptions propagate."""
    delay = first_delay_s
    for number in range(1, attempts + 1):
        try:
            return await attempt()
        except retry_on as exc:
            log.warning("%s: attempt %d/%d failed: %r", what, number, attempts, exc)
            if number == attempts:
                raise RetriesExhausted(attempts, exc) from exc
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
    raise ValueError(f"attempts must be >= 1, got {attempts}")
