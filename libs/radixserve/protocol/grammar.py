"""Grammar compilation (tokenizer -> grammar) and fetch by key (worker -> grammar).

Both are NATS request/reply on subjects with the `grammar` queue group. A grammar
is named by `grammar_key(kind, source, tokenizer_id)`, the same on every host, so
the key is also the grammar cache's key in Redis.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from radixserve.protocol.base import Message

# `structural_tag`: SGLang's / xgrammar's structural tag (a JSON object) as the source.
GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]

# `GrammarCompileReply.code` / `GrammarFetchReply.code` values.
GRAMMAR_INVALID = "invalid_grammar"  # the compiler refused the source: a 400 with its message
GRAMMAR_NOT_SUPPORTED = "grammar_not_supported"  # no grammar engine for this kind: a 400
GRAMMAR_UNAVAILABLE = "grammar_unavailable"  # retry later (compile timeout, wrong tokenizer): 503
GRAMMAR_UNKNOWN_KEY = "unknown_key"  # fetch: no grammar of that key in memory or in Redis


def grammar_key(kind: GrammarKind, source: str, tokenizer_id: str) -> str:
    """A stable name for a grammar compiled for one tokenizer: `kind:sha256-hex[:32]`."""
    h = hashlib.sha256()
    for part in (kind, tokenizer_id, source):
        data = part.encode("utf-8")
        # Length-prefix each part so ("a", "bc") and ("ab", "c") cannot collide.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return f"{kind}:{h.hexdigest()[:32]}"


class GrammarCompileRequest(Message, frozen=True):
    """tokenizer -> grammar: compile `source` for the tokenizer named `tokenizer_id`."""

    rid: str
    kind: GrammarKind
    source: str
    tokenizer_id: str


class GrammarCompileReply(Message, frozen=True):
    """grammar -> tokenizer: the key on success, or why the grammar is invalid (a 400).

    `code` says what a refusal means (GRAMMAR_INVALID, GRAMMAR_NOT_SUPPORTED,
    GRAMMAR_UNAVAILABLE; None from a service one release behind: not supported).
    `cached`: the grammar was not compiled for this request, it came from the
    service's memory or from Redis (another replica, or before a restart, compiled it).
    """

    rid: str
    key: str
    ok: bool
    error: str | None = None
    code: str | None = None
    cached: bool = False


class GrammarFetchRequest(Message, frozen=True):
    """worker -> grammar: the compiled grammar named `key`."""

    rid: str
    key: str


class GrammarFetchReply(Message, frozen=True):
    """grammar -> worker.

    `compiled` is the grammar service's serialized compiled grammar (xgrammar's own
    JSON serialization, zlib-compressed) and `compiled_format` names that format
    (`xgrammar-<serialization version>+zlib`); the source fields travel too, so a
    worker whose xgrammar cannot read the artifact (another version, another
    vocabulary size), or a reply without one (too large for a message), compiles the
    grammar itself instead of failing the request.
    """

    rid: str
    key: str
    ok: bool
    kind: GrammarKind | None = None
    source: str | None = None
    tokenizer_id: str | None = None
    compiled: bytes | None = None
    error: str | None = None
    compiled_format: str | None = None
    code: str | None = None
