"""Blocking readiness probes: does a server on host:port answer its protocol?

A bare TCP accept is not enough (the port may belong to something else), so NATS
must send its ``INFO`` greeting and Redis must answer ``PING`` with ``+PONG``.
"""

from __future__ import annotations

import socket


def nats_answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a NATS server on host:port greets with ``INFO {...}``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            return _read_line(sock).startswith(b"INFO ")
    except OSError:
        return False


def redis_answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a Redis server on host:port answers an inline ``PING`` (with ``PONG``,
    or, when it wants credentials, ``NOAUTH``: a Redis all the same)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return _read_line(sock).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _read_line(sock: socket.socket, limit: int = 65536) -> bytes:
    buf = b""
    while b"\r\n" not in buf and len(buf) < limit:
        chunk = sock.recv(4096)  # the socket's timeout bounds this
        if not chunk:
            break
        buf += chunk
    return buf
