"""What a `StepOutputBatch` says about each choice, read without decoding the rest.

The scheduler sees every engine step of every worker; it needs each output's rid,
index, finish kind, and (to re-route a request whose worker dies with the tokens it
had generated) its new token ids as packed bytes and its token count. Decoding into
these narrow structs skips the logprobs and detokenizer fields (msgspec ignores
fields a struct does not declare), and leaves the ids packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from radixserve.protocol import FinishKind, decode


class _FinishOnly(msgspec.Struct):
    kind: FinishKind


class _OutputProgress(msgspec.Struct):
    rid: str
    index: int = 0
    new_token_ids: bytes = b""
    completion_tokens: int = 0
    finish_reason: _FinishOnly | None = None


class _StepProgress(msgspec.Struct):
    outputs: list[_OutputProgress] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class ChoiceProgress:
    """One choice's step: its new ids (packed int32), the worker's total so far, and
    its finish kind once it finished."""

    rid: str
    index: int
    new_token_ids: bytes
    completion_tokens: int
    finish: FinishKind | None


def step_progress(data: bytes) -> list[ChoiceProgress]:
    """Each output of an encoded `StepOutputBatch`; ProtocolError if malformed."""
    batch = decode(data, _StepProgress)
    return [
        ChoiceProgress(
            out.rid,
            out.index,
            out.new_token_ids,
            out.completion_tokens,
            None if out.finish_reason is None else out.finish_reason.kind,
        )
        for out in batch.outputs
    ]
