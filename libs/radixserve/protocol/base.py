"""The base every wire message derives from, so all of them share one msgspec config."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of every NATS message body.

    - Encoded as msgpack *maps* (field names on the wire), not arrays: a service that
      is one release behind ignores fields it does not know and fills defaults for
      fields the sender left out, so services can be upgraded one at a time.
    - `omit_defaults`: a field equal to its default is not sent; the optional
      fields most requests leave unset cost nothing.
    - `frozen`: a message is a value; build a changed copy with `msgspec.structs.replace`.
      Subclasses repeat `frozen=True` because mypy does not see inherited struct
      config (it reports a non-frozen subclass as an error, which is the guard).
    """
