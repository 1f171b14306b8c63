"""One request's whole state as it moves through the engine (the nano-vllm `Sequence`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.engine.constrained.state import GrammarState
    from radixserve.engine.sampling.params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = 1  # queued (new, retracted, or between chunks it is still RUNNING)
    RUNNING = 2  # holds a request row and KV slots
    FINISHED = 3


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]  # eos ids (unless ignore_eos) + params.stop_token_ids
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    # KV state. prefix_indices are slots owned by the prefix cache (locked through
    # last_node); slots past them up to kv_len are owned by this request alone.
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor | None = None
    last_node: Any = None
    kv_len: int = 0  # tokens whose KV is written (req_to_token[row, :kv_len] is valid)
    # Filled by the scheduler when the request is admitted for the first time.
    cached_tokens: int = 0
    prefill_done: bool = False  # whole fill_ids minus the last token have KV
    # Per-step plan.
    extend_len: int = 0
    # Overlap scheduling: tokens sampled on the device whose ids the host has not read
    # yet (0 or 1 between steps); the next step's input refers to row `future_row` of
    # the sampled ids of the step in flight. output_ids holds only the tokens read.
    num_pending: int = 0
    future_row: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt logprobs (return_logprob with logprob_start_len >= 0): entry i is prompt token
    # max(logprob_start_len, 1) + i given the tokens before it, filled as the prefill's
    # chunks run; `input_logprob_next` is the next prompt position due (-1: none or done).
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprob_next: int = -1
    # Stop strings: the output text, checked after every new token (only if params.stop).
    stop_text_tail: str = ""
    num_retractions: int = 0
    # Admission: a higher priority is admitted first (sched/policy.py). arrival_time is
    # the scheduler's clock when first queued (None until then); arrival_order its rank.
    priority: int = 0
    arrival_time: float | None = None
    arrival_order: int = 0
    # Structured outputs: this request's own grammar matcher (engine/constrained); None
    # when unconstrained. Never shared, not even between the n choices of one prompt.
    grammar: GrammarState | None = None
    # Resumed (re-routed after its worker died): how many of output_ids came from there.
    resumed: int = 0

    def __post_init__(self) -> None:
        start = self.params.logprob_start_len
        if self.params.return_logprob and 0 <= start:
            # Token 0 has nothing before it: its entry is reported without a logprob.
            first = max(start, 1)
            self.input_logprob_next = first if first < len(self.origin_input_ids) else -1

    def resume(self, ids: list[int]) -> None:
        """Start with `ids` (token ids in the vocabulary) as the first output tokens, the
        ones another worker generated: they count as output for the limits, penalties,
        the sampler's position and the grammar, whose matcher is replayed through them
        (call after `grammar` is set). The prompt's logprobs went out with the first
        worker's outputs: none are scored again. ValueError for more tokens than
        max_new_tokens or ones the grammar refuses."""
        if len(ids) > self.params.max_new_tokens:
            raise ValueError(
                f"resume_ids has {len(ids)} tokens; max_new_tokens is {self.params.max_new_tokens}"
            )
        if self.grammar is not None:
            self.grammar.replay(ids)
        self.output_ids = list(ids)
        self.resumed = len(ids)
        self.input_logprob_next = -1

    @property
    def input_logprob_head(self) -> int | None:
        """The prompt's first token when its logprobs start at 0: reported, without a
        logprob (nothing comes before it); else None (and for a resumed request)."""
        head = self.params.logprob_start_len == 0 and bool(self.origin_input_ids)
        return self.origin_input_ids[0] if head and not self.resumed else None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before its next sample. Read-only: before
        the first output token it is the prompt list itself (no copy per call)."""
        return self.origin_input_ids + self.output_ids if self.output_ids else self.origin_input_ids

    @property
    def seq_len(self) -> int:
        """Prompt + outputs, counting the ones still on the device (num_pending)."""
        return len(self.origin_input_ids) + len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids) - self.num_pending, 0)
