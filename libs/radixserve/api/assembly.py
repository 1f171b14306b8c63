"""Put a request's answer together from the `TextDelta`s the detokenizer sends.

    assembly = Assembly(plan)
    update = assembly.apply(delta)      # None for a delta that is not ours (or late)
    if assembly.done: body = chat_completion(plan, assembly, created)

Each (rid, choice) of the plan is one `ChoiceState`, addressed by its merged index.
Counters in deltas are totals so far, so the latest value wins (a repeated or
reordered delta cannot inflate usage); text, ids (packed, as they came: unpacked only
when asked for) and logprobs are appended, less what a delta's offsets say the choice
already has (a detokenizer that restarted sends each choice again from its start). With a reasoning parser (chat), each
choice's reasoning tokens are counted here too, from each delta's text and token ids
as they are appended (`ReasoningTokens`), so the streamed usage and the whole body's
agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from radixserve.api.mapping import GenerationPlan
from radixserve.chat_format.reasoning import ReasoningTokens
from radixserve.protocol import (
    FinishReason,
    LogprobEntry,
    PromptLogprobEntries,
    TextDelta,
    num_tokens,
    unpack_tokens,
)


@dataclass
class ChoiceState:
    """Everything one choice produced so far."""

    index: int  # merged: prompt_index * n + choice
    rid: str
    prompt_index: int
    text: str = ""
    packed_ids: bytearray = field(default_factory=bytearray)  # the token ids, packed int32
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: PromptLogprobEntries | None = None
    finish: FinishReason | None = None
    completion_tokens: int = 0
    # With a reasoning parser: how many of its tokens are reasoning so far.
    reasoning_counter: ReasoningTokens | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.packed_ids)

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.reasoning_counter is None else self.reasoning_counter.count


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int | None = None  # of the completion tokens; None: no parser

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChoiceUpdate(NamedTuple):
    """What one delta changed: its choice (after the change) and the delta itself."""

    choice: ChoiceState
    delta: TextDelta


@dataclass
class _PromptCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Assembly:
    """The growing answer of one `GenerationPlan`."""

    def __init__(self, plan: GenerationPlan) -> None:
        self.plan = plan
        self.choices: list[ChoiceState] = []
        self._prompts = [_PromptCounters() for _ in plan.rids]
        # A delta's (rid, index) -> its choice and its prompt's counters.
        self._slots: dict[tuple[str, int], tuple[ChoiceState, _PromptCounters]] = {}
        for prompt_index, rid in enumerate(plan.rids):
            for choice in range(plan.n):
                state = ChoiceState(plan.choice_index(prompt_index, choice), rid, prompt_index)
                if plan.reasoning is not None:
                    state.reasoning_counter = ReasoningTokens(plan.reasoning)
                self.choices.append(state)
                self._slots[rid, choice] = (state, self._prompts[prompt_index])
        self._unfinished = len(self.choices)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def apply(self, delta: TextDelta) -> ChoiceUpdate | None:
        """Fold `delta` into its choice; None when it belongs to no unfinished choice or
        brings nothing the choice does not have. The update's delta is the new part."""
        slot = self._slots.get((delta.rid, delta.index))
        if slot is None:
            return None
        choice, counters = slot
        if choice.finish is not None:
            return None  # a late or repeated final delta
        if delta.prompt_tokens > counters.prompt_tokens:
            counters.prompt_tokens = delta.prompt_tokens
        if delta.cached_tokens > counters.cached_tokens:
            counters.cached_tokens = delta.cached_tokens
        if delta.completion_tokens > choice.completion_tokens:
            choice.completion_tokens = delta.completion_tokens
        new = _new_part(choice, delta)
        if new is not delta and not (new.text or new.token_ids or new.finish_reason):
            return None  # all of it already here
        delta = new
        choice.text += delta.text
        choice.packed_ids += delta.token_ids
        if choice.reasoning_counter is not None:
            last = delta.finish_reason is not None
            choice.reasoning_counter.feed(delta.text, num_tokens(delta.token_ids), last)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:  # once (again after a re-route: the same)
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            choice.finish = delta.finish_reason
            self._unfinished -= 1
        return ChoiceUpdate(choice, delta)

    def usage(self) -> Usage:
        """Prompt tokens once per prompt (not per choice); completion tokens (and with a
        reasoning parser, reasoning tokens) of every choice."""
        reasoning = None
        if self.plan.reasoning is not None:
            reasoning = sum(c.reasoning_tokens for c in self.choices)
        return Usage(
            prompt_tokens=sum(p.prompt_tokens for p in self._prompts),
            completion_tokens=sum(c.completion_tokens for c in self.choices),
            cached_tokens=sum(p.cached_tokens for p in self._prompts),
            reasoning_tokens=reasoning,
        )

    def prompt_usage(self, prompt_index: int) -> tuple[int, int]:
        """(prompt_tokens, cached_tokens) of one prompt."""
        counters = self._prompts[prompt_index]
        return counters.prompt_tokens, counters.cached_tokens

    def unfinished_rids(self) -> list[str]:
        """The rids that still have a running choice (what an abort must reach)."""
        rids: list[str] = []
        for choice in self.choices:
            if not choice.finished and choice.rid not in rids:
                rids.append(choice.rid)
        return rids

    def aborted(self) -> ChoiceState | None:
        """The first choice that ended with finish kind `abort`, if any."""
        return next(
            (c for c in self.choices if c.finish is not None and c.finish.kind == "abort"), None
        )


def _new_part(choice: ChoiceState, delta: TextDelta) -> TextDelta:
    """`delta` less the text and ids before the choice's end (by its offsets), and less
    prompt logprobs the choice has: the same delta when it starts where the choice ends."""
    skip_text = 0 if delta.text_offset is None else len(choice.text) - delta.text_offset
    skip_ids = 0
    if delta.token_offset is not None:
        skip_ids = len(choice.packed_ids) // 4 - delta.token_offset
    repeats_prompt = delta.prompt_logprobs is not None and choice.prompt_logprobs is not None
    if skip_text <= 0 and skip_ids <= 0 and not repeats_prompt:
        return delta
    skip_text, skip_ids = max(skip_text, 0), max(skip_ids, 0)
    logprobs = delta.logprobs
    if logprobs is not None and skip_ids:
        logprobs = logprobs[skip_ids:]
    return msgspec.structs.replace(
        delta,
        text=delta.text[skip_text:],
        token_ids=delta.token_ids[4 * skip_ids :],
        text_offset=None if delta.text_offset is None else delta.text_offset + skip_text,
        token_offset=None if delta.token_offset is None else delta.token_offset + skip_ids,
        logprobs=logprobs,
        prompt_logprobs=None if repeats_prompt else delta.prompt_logprobs,
    )
