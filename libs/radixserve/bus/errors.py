"""Errors the bus raises; all derive from BusError."""

from __future__ import annotations


class BusError(RuntimeError):
    """Base class for NATS bus failures."""


class BusConnectError(BusError):
    """No connection after the configured number of attempts."""


class BusAuthError(BusConnectError):
    """The server refused the credentials (or TLS): trying again cannot help."""


class BusClosed(BusError):
    """The bus was drained or closed; it cannot publish or subscribe any more."""


class BusPayloadTooLarge(BusError):
    """A message larger than the server's max_payload (1 MiB by default): resending it
    cannot succeed, so callers answer "too large" rather than "retry"."""


class BusTimeout(BusError, TimeoutError):
    """A request got no reply within its timeout."""

    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(f"request on {subject!r} got no reply within {timeout_s:.3f}s")
        self.subject = subject
        self.timeout_s = timeout_s


class BusNoResponders(BusError):
    """A request found no subscriber on its subject (the server said so at once)."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject!r}")
        self.subject = subject
