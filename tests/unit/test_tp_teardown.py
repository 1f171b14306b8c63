"""destroy_tp_group ends within its timeout even when a communicator's teardown cannot
(NCCL's waits for a collective a lost rank will never join): it logs and leaves the
teardown behind; a teardown's error reaches the caller."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import pytest

from radixserve.engine import distributed
from radixserve.engine.distributed import SINGLE, destroy_tp_group


class _StuckComm:
    """A communicator whose close waits until released (as NCCL's can, forever)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def close(self) -> None:
        self.release.wait(60)


class _FailingComm:
    def close(self) -> None:
        raise RuntimeError("ncclCommDestroy failed")


def _group(comm: Any) -> distributed.TPGroup:
    return dataclasses.replace(SINGLE, nccl=comm)


def test_a_stuck_teardown_is_left_behind(caplog: pytest.LogCaptureFixture) -> None:
    comm = _StuckComm()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=distributed.__name__):
        destroy_tp_group(_group(comm), timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert "did not shut down within" in caplog.text
    comm.release.set()


def test_a_teardown_error_reaches_the_caller() -> None:
    with pytest.raises(RuntimeError, match="ncclCommDestroy failed"):
        destroy_tp_group(_group(_FailingComm()), timeout_s=5)
