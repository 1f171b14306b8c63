"""Token ids -> text, incrementally: the detokenizer service's library and the engine's.

    detok = IncrementalDetokenizer(tokenizer)
    for gateway_id, deltas in detok.process(step_batch).items():
        ...  # one TextDeltaBatch per gateway

    status = DecodeStatus(DetokParams(stop=["\\n\\n"]))       # one stream, by hand
    text = decode_step(tokenizer, status, new_ids, finish_reason)

Text that may still change is held back: a partial UTF-8 character, and while the
request runs, a tail that could be the start of a stop string. On finish the text
ends before the matched stop string (and the matched stop token) unless
`no_stop_trim`. Pure: no bus, no model; transformers only for typing.
"""

from __future__ import annotations

from radixserve.detok.incremental import (
    DEFAULT_MAX_REQUESTS,
    REPLACEMENT_CHAR,
    DecodeStatus,
    IncrementalDetokenizer,
    LostStream,
    StepGaps,
    TokenTexts,
    batch_decode,
    decode_step,
)
from radixserve.detok.stop import FinishLike, stop_prefix_len, trim_stop_string, trims_stop_token

__all__ = [
    "DEFAULT_MAX_REQUESTS",
    "REPLACEMENT_CHAR",
    "DecodeStatus",
    "FinishLike",
    "IncrementalDetokenizer",
    "LostStream",
    "StepGaps",
    "TokenTexts",
    "batch_decode",
    "decode_step",
    "stop_prefix_len",
    "trim_stop_string",
    "trims_stop_token",
]
