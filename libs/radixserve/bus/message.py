"""The message type handlers and requests see: bytes plus headers, no nats-py types."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg


@dataclass(frozen=True)
class BusMsg:
    """One NATS message. ``reply`` is the inbox to answer (empty when none);
    answer with ``Bus.respond(msg, data)`` so the trace context follows."""

    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    reply: str = ""

    @classmethod
    def from_nats(cls, msg: Msg) -> BusMsg:
        return cls(
            subject=msg.subject,
            data=bytes(msg.data),
            headers=dict(msg.headers or {}),
            reply=msg.reply or "",
        )
