"""A service's supervised tasks (`ServiceContext.spawn`): a crash stops the service as
failed; one while the service already stops is logged, not lost, and does not turn a
clean stop into a crash. (No bus is used by `spawn`.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from radixserve.services.runtime import ServiceContext, ServiceSettings


async def _boom() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("boom")


def _context() -> ServiceContext:
    return ServiceContext(settings=ServiceSettings(service="unit"), bus=None)  # type: ignore[arg-type]


async def test_a_crashed_task_stops_the_service_as_failed() -> None:
    ctx = _context()
    task = ctx.spawn(_boom(), "boom")
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # the done callback
    assert ctx.stopping.is_set()
    assert isinstance(ctx._crashed, RuntimeError)


async def test_a_task_failing_while_stopping_is_logged_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = _context()
    ctx.stopping.set()
    with caplog.at_level(logging.ERROR, logger="radixserve.services.runtime"):
        task = ctx.spawn(_boom(), "late")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert ctx._crashed is None
    assert "task late failed while stopping" in caplog.text


async def test_a_cancelled_task_is_neither() -> None:
    ctx = _context()
    task = ctx.spawn(asyncio.sleep(10), "sleeper")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not ctx.stopping.is_set() and ctx._crashed is None
