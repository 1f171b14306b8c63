"""A bus message's payload, or nothing: how every service handler reads what it is sent.

    beat = decode_or_drop(msg, Heartbeat, log)
    if beat is None:
        return

A malformed message is dropped with a log line naming its type and subject, never raised
into the handler: what it meant is dealt with by its sender's timeout, or the sweeps
that look for requests gone silent.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from radixserve.bus import BusMsg
from radixserve.protocol import ProtocolError, decode

T = TypeVar("T")


def decode_or_drop(
    msg: BusMsg, type_: type[T], log: logging.Logger, level: int = logging.WARNING
) -> T | None:
    """`msg`'s payload as `type_`, or None (logged at `level`) when it is malformed."""
    try:
        return decode(msg.data, type_)
    except ProtocolError as exc:
        log.log(level, "dropping a malformed %s on %s: %s", type_.__name__, msg.subject, exc)
        return None
