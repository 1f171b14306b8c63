"""The one exception the protocol raises for bytes or values that break the wire contract."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Malformed bytes, a wrong field type, or a value that cannot travel on the wire.

    A `ValueError` subclass so callers that already treat bad input as `ValueError`
    (the gateway's 400 path) catch it without knowing about the protocol.
    """
