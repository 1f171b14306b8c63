"""Which choices a `StepOutputBatch` finished, read without decoding the rest.

The scheduler sees every engine step of every worker; it needs only each output's
rid, index and finish kind. Decoding into these narrow structs skips the token ids
and logprobs (msgspec ignores fields a struct does not declare), so that cost stays
with the detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from radixserve.protocol import FinishKind, decode


class _FinishOnly(msgspec.Struct):
    kind: FinishKind


class _OutputFinish(msgspec.Struct):
    rid: str
    index: int = 0
    finish_reason: _FinishOnly | None = None


class _StepFinishes(msgspec.Struct):
    outputs: list[_OutputFinish] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class FinishedChoice:
    rid: str
    index: int
    kind: FinishKind


def finished_choices(data: bytes) -> list[FinishedChoice]:
    """The finished choices of an encoded `StepOutputBatch`; ProtocolError if malformed."""
    batch = decode(data, _StepFinishes)
    return [
        FinishedChoice(out.rid, out.index, out.finish_reason.kind)
        for out in batch.outputs
        if out.finish_reason is not None
    ]
