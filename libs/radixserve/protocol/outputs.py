"""Messages that carry results back: worker -> detokenizer -> gateway.

Both hops are batched: a worker publishes one `StepOutputBatch` per engine step
for every request that produced tokens or finished in that step, and the
detokenizer publishes one `TextDeltaBatch` per gateway per flush. Never one
message per token.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from radixserve.protocol.base import Message
from radixserve.protocol.tokens import num_tokens, unpack_tokens

FinishKind = Literal["stop", "length", "abort"]


class FinishReason(Message, frozen=True):
    """Why a request ended, as SGLang's `meta_info.finish_reason` (`kind` is its `type`).

    `matched` is the stop token id or stop string that ended it; `message` says why
    an abort happened.
    """

    kind: FinishKind
    matched: int | str | None = None
    message: str | None = None


class TopLogprobs(Message, frozen=True):
    """The top-k candidates at one output position (worker side: ids only)."""

    token_ids: bytes  # packed int32, same order as `logprobs`
    logprobs: list[float]

    def __post_init__(self) -> None:
        if num_tokens(self.token_ids) != len(self.logprobs):
            raise ValueError("top logprobs: token_ids and logprobs differ in length")

    @property
    def token_ids_list(self) -> list[int]:
        return unpack_tokens(self.token_ids)


class PromptLogprobs(Message, frozen=True):
    """The prompt's token logprobs (`return_logprob` with `logprob_start_len` >= 0), worker
    side: sent once, with a choice's first output. `token_ids` are the scored prompt
    tokens; `head_token_id` is the prompt's first token when the start is 0 (it has no
    logprob), else -1."""

    token_ids: bytes  # packed int32, same order as `logprobs`
    logprobs: list[float]
    top: list[TopLogprobs] | None = None
    head_token_id: int = -1

    def __post_init__(self) -> None:
        count = num_tokens(self.token_ids)
        if len(self.logprobs) != count or (self.top is not None and len(self.top) != count):
            raise ValueError("prompt logprobs: token_ids, logprobs and top differ in length")

    @property
    def token_ids_list(self) -> list[int]:
        return unpack_tokens(self.token_ids)


class DetokParams(Message, frozen=True):
    """What the detokenizer needs to know about a request to turn ids into text.

    Sent on a request's first `StepOutput` (and again after a re-route); the
    detokenizer keeps it with the request's decoding state.
    """

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = msgspec.field(default_factory=list)
    no_stop_trim: bool = False
    resumable: bool = False  # keep the text deltas in the store's output log


class StepOutput(Message, frozen=True):
    """One request's result of one engine step.

    Counters are totals so far (not increments), so a lost or repeated message
    cannot skew usage. `index` tells apart the `n` > 1 choices of one request.
    `token_logprobs` / `top_logprobs`, when the request asked for them, have one
    entry per id in `new_token_ids`.
    """

    rid: str
    gateway_id: str
    new_token_ids: bytes = b""  # packed int32
    index: int = 0
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    detok: DetokParams | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        count = num_tokens(self.new_token_ids)
        for name, values in (
            ("token_logprobs", self.token_logprobs),
            ("top_logprobs", self.top_logprobs),
        ):
            if values is not None and len(values) != count:
                raise ValueError(f"{name} has {len(values)} entries for {count} new tokens")

    @property
    def new_token_ids_list(self) -> list[int]:
        return unpack_tokens(self.new_token_ids)


class StepOutputBatch(Message, frozen=True):
    """worker -> detokenizer: every request's output of one engine step.

    `resent` answers a `DetokResync`: each a choice's whole output so far (ids from 0,
    its DetokParams, its finish if it finished lately), for a detokenizer that lost its
    state. It is a field of its own so the scheduler's progress reader, which declares
    only `outputs`, never counts those tokens twice.
    """

    worker_id: str
    step: int  # the worker's step counter; lets the detokenizer spot gaps
    outputs: list[StepOutput] = msgspec.field(default_factory=list)
    resent: list[StepOutput] = msgspec.field(default_factory=list)


class DetokResync(Message, frozen=True):
    """detokenizer -> every worker: send the whole output so far of these requests (all
    the worker runs or finished lately when `rids` is empty) in `StepOutputBatch.resent`.

    Asked by a detokenizer that meets a request it has no state for, or whose token
    counts show a hole (a restart, a lost batch); only the worker holding it answers.
    """

    rids: list[str] = msgspec.field(default_factory=list)
    reason: str = ""


class TopLogprobEntry(Message, frozen=True):
    """A top-k candidate with its text (gateway side, OpenAI `top_logprobs`)."""

    token_id: int
    token: str
    logprob: float


class LogprobEntry(Message, frozen=True):
    """One output token with its text, logprob and top-k candidates (OpenAI `logprobs`)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprobEntry] = msgspec.field(default_factory=list)


class PromptLogprobEntries(Message, frozen=True):
    """The prompt's token logprobs with their texts (gateway side). `head`: the prompt's
    first token when the start is 0, reported without a logprob (its `logprob` unused)."""

    entries: list[LogprobEntry] = msgspec.field(default_factory=list)
    head: LogprobEntry | None = None


class TextDelta(Message, frozen=True):
    """One request's new text since the last delta.

    `token_ids` are the ids behind this delta (for `/generate`'s `output_ids`); the
    text may lag them by a few ids while a multi-byte character is incomplete.
    Counters are totals so far, as in `StepOutput`.
    """

    rid: str
    text: str = ""
    token_ids: bytes = b""  # packed int32
    index: int = 0
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[LogprobEntry] | None = None
    worker_id: str = ""  # on a choice's first delta: the worker that runs it
    prompt_logprobs: PromptLogprobEntries | None = None  # once, on a choice's first delta
    # Where this delta starts in its choice: characters of text and ids before it (None:
    # unknown, appended as is). A receiver skips what it already has, so a delta rebuilt
    # from the start (`resent`) or repeated is never shown twice.
    text_offset: int | None = None
    token_offset: int | None = None
    resent: bool = False  # rebuilt from the worker's history (StepOutputBatch.resent)
    seq: int | None = None  # resumable requests: its number in the output log

    def __post_init__(self) -> None:
        num_tokens(self.token_ids)

    @property
    def token_ids_list(self) -> list[int]:
        return unpack_tokens(self.token_ids)


class TextDeltaBatch(Message, frozen=True):
    """detokenizer -> one gateway: the deltas of that gateway's requests."""

    gateway_id: str
    deltas: list[TextDelta] = msgspec.field(default_factory=list)
