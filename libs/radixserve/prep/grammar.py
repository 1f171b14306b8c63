"""The tokenizer's side of grammar compilation: what to ask the grammar service, and
what its answer (or its silence) means for the request."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.prep.errors import (
    GRAMMAR_NOT_SUPPORTED,
    GRAMMAR_UNAVAILABLE,
    INVALID_GRAMMAR,
    INVALID_REQUEST,
    PrepError,
)
from radixserve.protocol import GrammarCompileReply, GrammarCompileRequest, SamplingParams
from radixserve.protocol import grammar as wire
from radixserve.protocol.grammar import GrammarKind

_GRAMMAR_FIELDS: tuple[GrammarKind, ...] = ("regex", "json_schema", "ebnf", "structural_tag")
GRAMMAR_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class GrammarSpec:
    """The one grammar a request asks for: its kind (= the sampling field's name) and source."""

    kind: GrammarKind
    source: str

    @property
    def param(self) -> str:
        return self.kind


def grammar_spec(sampling: SamplingParams) -> GrammarSpec | None:
    """The request's grammar, None when unconstrained; PrepError when more than one is set."""
    given = [
        GrammarSpec(kind, source)
        for kind in _GRAMMAR_FIELDS
        if (source := getattr(sampling, kind)) is not None
    ]
    if len(given) > 1:
        names = ", ".join(spec.kind for spec in given)
        raise PrepError(
            f"at most one of regex, json_schema, ebnf, structural_tag may be set, got {names}",
            code=INVALID_REQUEST,
            param=given[1].param,
        )
    return given[0] if given else None


def compile_request(rid: str, spec: GrammarSpec, tokenizer_id: str) -> GrammarCompileRequest:
    return GrammarCompileRequest(
        rid=rid, kind=spec.kind, source=spec.source, tokenizer_id=tokenizer_id
    )


def key_from_reply(reply: GrammarCompileReply, spec: GrammarSpec) -> str:
    """The grammar key of a successful compile; PrepError (400) carrying the service's reason."""
    if reply.ok and reply.key:
        return reply.key
    reason = reply.error or "the grammar service refused the grammar without a reason"
    if reply.code == wire.GRAMMAR_UNAVAILABLE:  # a compile past its timeout, a wrong tokenizer
        raise _retry_later(spec, reason)
    if reply.code == wire.GRAMMAR_INVALID:
        raise PrepError(reason, code=INVALID_GRAMMAR, param=spec.param)
    # No code (a grammar service one release behind) or `grammar_not_supported`.
    raise PrepError(reason, code=GRAMMAR_NOT_SUPPORTED, param=spec.param)


def unavailable_error(spec: GrammarSpec, why: str) -> PrepError:
    """No answer from the grammar service (timeout, none running): a 503 to retry later."""
    return _retry_later(spec, f"the grammar service did not answer ({why}); retry later")


def _retry_later(spec: GrammarSpec, message: str) -> PrepError:
    return PrepError(
        message,
        code=GRAMMAR_UNAVAILABLE,
        param=spec.param,
        http_status=503,
        error_type="server_error",
        retry_after_s=GRAMMAR_RETRY_AFTER_S,
    )
