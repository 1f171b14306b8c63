"""`GrammarEntry`: one compiled grammar (or the compiler's refusal) as the caches hold it."""

from __future__ import annotations

import msgspec

from radixserve.protocol.grammar import GrammarKind


class GrammarEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the grammar service keeps per key, in memory and (msgpack) in Redis.

    `artifact` is the serialized compiled grammar (`artifact.serialize`), None when the
    compiler refused the source (`error`) or the grammar was compiled without one.
    """

    kind: GrammarKind
    source: str
    tokenizer_id: str
    artifact: bytes | None = None
    artifact_format: str | None = None
    error: str | None = None
    # Wall-clock time its compile was stopped past the time limit (`error` says so): a
    # refusal the registry keeps for a while only, since the load may have been to blame.
    stopped_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def size_bytes(self) -> int:
        return len(self.artifact or b"") + len(self.source) + 256

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> GrammarEntry:
        """Raises msgspec.DecodeError / ValidationError for bytes that are not an entry."""
        return msgspec.msgpack.decode(data, type=cls)
