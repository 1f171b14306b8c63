"""A NATS connect attempt is bounded even when its coroutine loses a cancellation (as
nats-py's first connect can on Python 3.11): the bound cancels until the task ends."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixserve.bus.client import _bounded


async def test_a_swallowed_cancellation_still_ends_in_timeout() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:  # like a connect loop over its servers, sleeping between tries
            try:
                await asyncio.sleep(0.25)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 1:
                    continue  # the first cancellation is lost
                raise

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no connection within 0.1s"):
        await _bounded(stubborn(), 0.1)
    assert swallowed == 2 and time.monotonic() - started < 1.0


async def test_a_result_or_an_error_comes_through() -> None:
    async def fine() -> None:
        await asyncio.sleep(0)

    async def refused() -> None:
        raise ConnectionRefusedError("nothing listens")

    assert await _bounded(fine(), 1.0) is None
    with pytest.raises(ConnectionRefusedError):
        await _bounded(refused(), 1.0)
