"""A compiled grammar as bytes: what the grammar service caches and a worker loads.

xgrammar serializes a compiled grammar (the grammar plus its adaptive token-mask
cache, the expensive part) as JSON; zlib shrinks it about threefold. The format
name carries xgrammar's serialization version, so a worker with another xgrammar
skips the artifact and compiles from the source instead of failing.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

# Level 1: most of the size win for a fraction of the time (1.7 MB -> 0.6 MB in ~10 ms).
_ZLIB_LEVEL = 1


class ArtifactMismatch(ValueError):
    """The artifact cannot be loaded here (another format, tokenizer or vocabulary size)."""


def artifact_format() -> str:
    import xgrammar as xgr

    return f"xgrammar-{xgr.get_serialization_version()}+zlib"


def serialize(compiled: xgr.CompiledGrammar) -> bytes:
    return zlib.compress(compiled.serialize_json().encode("utf-8"), _ZLIB_LEVEL)


def deserialize(
    blob: bytes, info: xgr.TokenizerInfo, fmt: str | None = None
) -> xgr.CompiledGrammar:
    """The compiled grammar for `info`; ArtifactMismatch if it was built for another one."""
    import xgrammar as xgr

    if fmt is not None and fmt != artifact_format():
        raise ArtifactMismatch(f"artifact format {fmt!r}, this worker reads {artifact_format()!r}")
    try:
        text = zlib.decompress(blob).decode("utf-8")
        return xgr.CompiledGrammar.deserialize_json(text, info)
    except (zlib.error, UnicodeDecodeError, RuntimeError, ValueError) as exc:
        # DeserializeFormatError / DeserializeVersionError / InvalidJSONError are
        # RuntimeError or ValueError subclasses: another tokenizer or vocabulary size.
        raise ArtifactMismatch(str(exc).strip().splitlines()[0][:300]) from exc
