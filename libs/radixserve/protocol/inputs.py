"""Messages that carry a request toward a worker: gateway -> tokenizer -> scheduler -> worker."""

from __future__ import annotations

import msgspec

from radixserve.protocol.base import Message
from radixserve.protocol.subjects import check_token
from radixserve.protocol.tokens import num_tokens, unpack_tokens


class SamplingParams(Message, frozen=True):
    """Sampling parameters with SGLang's field names and defaults.

    Only the types are checked here (msgspec, at decode); ranges and combinations
    (temperature >= 0, top_p in (0, 1], ...) are the engine's to reject, in one place.
    `regex` / `json_schema` / `ebnf` hold the user's source; the tokenizer turns them
    into a `grammar_key` and at most one of them may be set (the engine checks).
    `stop` is always a list: the gateway normalizes a bare string.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from here (-1: none)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's structural tag (JSON text); a grammar too
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit


class ChatToolCall(Message, frozen=True):
    """A function call an assistant message made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


class ChatMessage(Message, frozen=True):
    """One message of a chat conversation (text content; the gateway flattens parts).

    `tool_calls`: the calls an assistant message made; `tool_call_id`: which call a
    `tool` message answers."""

    role: str
    content: str
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class SubmitRequest(Message, frozen=True):
    """gateway -> tokenizer: a new request, exactly one of `text` / `input_ids` / `messages`.

    `gateway_id` names the gateway instance that owns the request: its text deltas
    and errors go to that gateway's own subjects. `arrival_time` is wall-clock
    seconds (`time.time()`), the only clock that compares across hosts.
    `priority`: a higher value is admitted first. `tools`: the functions a chat model may
    call, JSON text of OpenAI's `tools` list, rendered into the prompt by the chat
    template.
    """

    rid: str
    gateway_id: str
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    text: str | None = None
    input_ids: bytes | None = None  # packed int32, see `pack_tokens`
    messages: list[ChatMessage] | None = None
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    model: str = ""
    tools: str | None = None
    chat_template_kwargs: str | None = None  # JSON text of an object: more template variables
    # A last assistant message continued (its prefix the start of the answer) instead of
    # a new assistant turn opened after it.
    continue_final_message: bool = False
    # Its outputs are kept in the store's output log, so a client may resume it elsewhere.
    resumable: bool = False

    def __post_init__(self) -> None:
        # Runs on decode too, where the ValueError surfaces as a ProtocolError.
        check_token(self.gateway_id, "gateway id")
        given = [
            name
            for name, value in (
                ("text", self.text),
                ("input_ids", self.input_ids),
                ("messages", self.messages),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of text, input_ids, messages must be set, got {given or 'none'}"
            )
        if self.input_ids is not None:
            num_tokens(self.input_ids)  # checks the packed length

    @property
    def input_ids_list(self) -> list[int] | None:
        return None if self.input_ids is None else unpack_tokens(self.input_ids)


class TokenizedRequest(Message, frozen=True):
    """tokenizer -> scheduler: the prompt as token ids, ready to route.

    `grammar_key` is set when the request is grammar constrained; the grammar service
    has compiled it (or is compiling it) and the worker fetches it by this key.
    """

    rid: str
    gateway_id: str
    input_ids: bytes  # packed int32
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    grammar_key: str | None = None
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    model: str = ""
    resumable: bool = False

    def __post_init__(self) -> None:
        num_tokens(self.input_ids)

    @property
    def input_ids_list(self) -> list[int]:
        return unpack_tokens(self.input_ids)

    @property
    def prompt_tokens(self) -> int:
        return num_tokens(self.input_ids)


class RoutedRequest(Message, frozen=True):
    """scheduler -> worker: a tokenized request and where and why it was sent.

    `expected_cached_tokens` is the prefix length the scheduler's mirror of this
    worker's radix tree matched; the worker reports the real `cached_tokens` in
    its outputs, so the two can be compared (a mirror that drifts shows up there).
    `attempt` counts re-routes after a worker died (0 on the first route).
    `output_prefix`: on a re-route of a request of one choice, the tokens it had
    generated (packed int32): the new worker continues after them, so its outputs count
    them too. `choice_prefixes`: the same for a request of n > 1 choices, entry i for
    choice i: the tokens it had generated (maybe none), or None for a choice that has
    finished (not run again). Neither is set on a first route.
    """

    request: TokenizedRequest
    worker_id: str
    expected_cached_tokens: int = 0
    routed_at: float = 0.0
    attempt: int = 0
    output_prefix: bytes | None = None
    choice_prefixes: list[bytes | None] | None = None

    def __post_init__(self) -> None:
        if self.output_prefix is not None:
            num_tokens(self.output_prefix)  # checks the packed length
        prefixes = self.choice_prefixes
        if prefixes is None:
            return
        if self.output_prefix is not None:
            raise ValueError("a routed request has output_prefix or choice_prefixes, not both")
        n = self.request.sampling.n
        if len(prefixes) != n:
            raise ValueError(f"choice_prefixes is for n = {n} choices, got {len(prefixes)}")
        if all(prefix is None for prefix in prefixes):
            raise ValueError("choice_prefixes leaves no choice to run")
        for prefix in prefixes:
            if prefix is not None:
                num_tokens(prefix)

    @property
    def rid(self) -> str:
        return self.request.rid
