"""decode_or_drop: a bus message's payload, or None with a log line naming the type and
subject when it is malformed (never an exception into a service's handler)."""

from __future__ import annotations

import logging

import pytest

from radixserve.bus import BusMsg
from radixserve.protocol import AbortRequest, Heartbeat, encode
from radixserve.services.messages import decode_or_drop

log = logging.getLogger("test.messages")


def test_a_good_message_is_decoded() -> None:
    abort = AbortRequest(rid="r-1", reason="client gone")
    assert decode_or_drop(BusMsg("p.abort", encode(abort)), AbortRequest, log) == abort


@pytest.mark.parametrize("data", [b"", b"\xc1", encode(AbortRequest(rid="r-1"))])
def test_a_malformed_message_is_dropped_and_logged(
    data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="test.messages"):
        assert decode_or_drop(BusMsg("p.heartbeat.w-1", data), Heartbeat, log) is None
        assert decode_or_drop(BusMsg("p.x", data), Heartbeat, log, logging.ERROR) is None
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.ERROR]
    assert "malformed Heartbeat on p.heartbeat.w-1" in caplog.records[0].getMessage()
