"""Every NATS subject and message type of radixserve, defined once.

    from radixserve.protocol import Subjects, SubmitRequest, encode, decode

    subjects = Subjects(prefix="radixserve")
    await nc.publish(subjects.tokenize, encode(SubmitRequest(...)))
    msg = decode(raw, SubmitRequest)   # ProtocolError if malformed

Token id arrays travel as packed int32 bytes (`pack_tokens` / `unpack_tokens`).
"""

from __future__ import annotations

from radixserve.protocol.base import Message
from radixserve.protocol.codec import (
    convert,
    decode,
    decode_json,
    decoder_for,
    encode,
    encode_json,
)
from radixserve.protocol.control import (
    REQUEST_TOO_LARGE,
    RUN_REFUSED_HEADER,
    AbortRequest,
    FlushCacheReply,
    FlushCacheRequest,
    InflightQuery,
    InflightReply,
    RequestError,
    retry_later_error,
    too_large_error,
)
from radixserve.protocol.errors import ProtocolError
from radixserve.protocol.grammar import (
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    GrammarKind,
    grammar_key,
)
from radixserve.protocol.inputs import (
    ChatMessage,
    ChatToolCall,
    RoutedRequest,
    SamplingParams,
    SubmitRequest,
    TokenizedRequest,
)
from radixserve.protocol.kv_events import (
    AllBlocksCleared,
    KvEvent,
    KvEventBatch,
    KvSnapshotRequest,
    OffloadedBlocks,
    RemovedBlocks,
    RestoredBlocks,
    StoredBlocks,
    block_hashes,
    split_events,
)
from radixserve.protocol.outputs import (
    DetokParams,
    DetokResync,
    FinishKind,
    FinishReason,
    LogprobEntry,
    PromptLogprobEntries,
    PromptLogprobs,
    StepOutput,
    StepOutputBatch,
    TextDelta,
    TextDeltaBatch,
    TopLogprobEntry,
    TopLogprobs,
)
from radixserve.protocol.subjects import (
    DEFAULT_PREFIX,
    QueueGroups,
    Subjects,
    check_token,
    subject_matches,
)
from radixserve.protocol.tokens import (
    TOKEN_DTYPE,
    num_tokens,
    pack_tokens,
    unpack_tokens,
    unpack_tokens_array,
)
from radixserve.protocol.workers import (
    Heartbeat,
    HeldRequest,
    ServiceHeartbeat,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
)

__all__ = [
    "DEFAULT_PREFIX",
    "REQUEST_TOO_LARGE",
    "RUN_REFUSED_HEADER",
    "TOKEN_DTYPE",
    "AbortRequest",
    "AllBlocksCleared",
    "ChatMessage",
    "ChatToolCall",
    "DetokParams",
    "DetokResync",
    "FinishKind",
    "FinishReason",
    "FlushCacheReply",
    "FlushCacheRequest",
    "GrammarCompileReply",
    "GrammarCompileRequest",
    "GrammarFetchReply",
    "GrammarFetchRequest",
    "GrammarKind",
    "Heartbeat",
    "HeldRequest",
    "InflightQuery",
    "InflightReply",
    "KvEvent",
    "KvEventBatch",
    "KvSnapshotRequest",
    "LogprobEntry",
    "Message",
    "OffloadedBlocks",
    "PromptLogprobEntries",
    "PromptLogprobs",
    "ProtocolError",
    "QueueGroups",
    "RemovedBlocks",
    "RequestError",
    "RestoredBlocks",
    "RoutedRequest",
    "SamplingParams",
    "ServiceHeartbeat",
    "StepOutput",
    "StepOutputBatch",
    "StoredBlocks",
    "Subjects",
    "SubmitRequest",
    "TextDelta",
    "TextDeltaBatch",
    "TokenizedRequest",
    "TopLogprobEntry",
    "TopLogprobs",
    "WorkerCapacity",
    "WorkerStats",
    "WorkerStatus",
    "block_hashes",
    "check_token",
    "convert",
    "decode",
    "decode_json",
    "decoder_for",
    "encode",
    "encode_json",
    "grammar_key",
    "num_tokens",
    "pack_tokens",
    "retry_later_error",
    "split_events",
    "subject_matches",
    "too_large_error",
    "unpack_tokens",
    "unpack_tokens_array",
]
