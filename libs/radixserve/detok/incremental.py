"""Incremental detokenization: token ids in, text deltas out, never a broken character.

SGLang's `detokenizer_manager` is the model. Each output stream (one choice of one
request) keeps a `DecodeStatus`. A step decodes two short windows, the ids
committed by the previous step (the context) and the context plus the new ids; the
new text is the difference, so a token's text is right even where it depends on its
neighbours, and no step re-decodes the whole output. Byte-fallback tokens decode to
U+FFFD until the rest of their character arrives, so text is committed only when
it ends on a whole character; until then only the whole characters before the
split one go out.

`IncrementalDetokenizer` runs this for every request of a `StepOutputBatch` with
one `batch_decode` call; the engine's own streaming calls `decode_step` per request.
Its state is rebuilt on demand: a request it meets mid-way (a restart, an evicted or
lost stream) is asked of the workers (`take_resyncs`), whose answer, the whole output
so far (`StepOutputBatch.resent`), is decoded from the start; each delta says where it
starts (`text_offset`, `token_offset`), so the gateway skips what it already has.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from radixserve.detok.stop import FinishLike, stop_prefix_len, trim_stop_string, trims_stop_token
from radixserve.protocol import (
    DetokParams,
    LogprobEntry,
    PromptLogprobEntries,
    PromptLogprobs,
    StepOutput,
    StepOutputBatch,
    TextDelta,
    TopLogprobEntry,
    TopLogprobs,
    num_tokens,
    unpack_tokens,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
DEFAULT_MAX_REQUESTS = 65536
RESYNC_TIMEOUT_S = 5.0  # how long a request's history may take to come before it fails


def batch_decode(
    tokenizer: PreTrainedTokenizerBase,
    sequences: list[list[int]],
    *,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> list[str]:
    """One tokenizer call for many id lists, with the request's special-token options.

    `spaces_between_special_tokens` (kept special tokens only): a special token is
    separated from its neighbours by a space where the text has none, as Hugging
    Face's Python tokenizers did (without their doubled spaces); fast tokenizers
    ignore the option, so it is applied here, for every tokenizer.
    """
    if not sequences:
        return []
    if skip_special_tokens or not spaces_between_special_tokens:
        texts = tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
        return [str(text) for text in texts]
    special = frozenset(tokenizer.all_special_ids)
    return [_decode_spaced(tokenizer, ids, special) for ids in sequences]


def _decode_spaced(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], special: frozenset[int]
) -> str:
    """Runs of ordinary tokens decoded together, special tokens alone, joined by a space
    wherever neither side already has whitespace."""
    if not special.intersection(ids):
        return str(tokenizer.decode(ids, skip_special_tokens=False))
    runs: list[list[int]] = []
    for token in ids:
        if token in special or not runs or runs[-1][-1] in special:
            runs.append([token])
        else:
            runs[-1].append(token)
    texts = [str(text) for text in tokenizer.batch_decode(runs, skip_special_tokens=False)]
    out = texts[0]
    for text in texts[1:]:
        if out and text and not out[-1].isspace() and not text[0].isspace():
            out += " "
        out += text
    return out


@dataclass
class DecodeStatus:
    """The decoding state of one output stream (one choice of one request).

    `ids[surr_offset:read_offset]` is the context decoded before and with the new ids;
    everything before `read_offset` is committed (its text ends on a whole character).
    `held_text` is committed text not yet returned (it could be the start of a stop
    string); `sent_partial` counts characters already returned from the uncommitted
    tail (whole characters before a split one). Only the unsent text is kept, so a
    long output costs no growing string copies.
    """

    params: DetokParams = field(default_factory=DetokParams)
    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    held_text: str = ""
    sent_partial: int = 0
    finished: bool = False
    tokens: int = 0  # ids received (valid or not): the worker's count before the next step
    text_sent: int = 0  # characters returned so far (the next delta's text_offset)

    def push(self, new_ids: Iterable[int]) -> None:
        if not self.finished:
            self.ids.extend(new_ids)

    def windows(self, finish: FinishLike | None) -> tuple[list[int], list[int]]:
        """(context ids, context + new ids) to decode for this step."""
        end = len(self.ids)
        if trims_stop_token(self.ids, finish, self.params.no_stop_trim):
            end = max(end - 1, self.read_offset)
        return self.ids[self.surr_offset : self.read_offset], self.ids[self.surr_offset : end]

    def advance(
        self,
        context_text: str,
        window_text: str,
        finish: FinishLike | None,
        *,
        final: bool | None = None,
    ) -> str:
        """Take the decoded windows of this step; return the text that can go out now.

        `final` (default: `finish` is set) flushes everything, trimmed at the matched
        stop string; after it the stream returns nothing more.
        """
        if self.finished:
            return ""
        is_final = finish is not None if final is None else final
        new_text = window_text[len(context_text) :]
        whole = is_final or (bool(new_text) and not new_text.endswith(REPLACEMENT_CHAR))
        if whole:
            fresh = new_text[self.sent_partial :]
            self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
            self.sent_partial = 0
        else:
            fresh = new_text.rstrip(REPLACEMENT_CHAR)[self.sent_partial :]
        unsent = self.held_text + fresh
        if is_final:
            self.finished = True
            self.held_text = ""
            return trim_stop_string(unsent, finish, self.params.no_stop_trim)
        out = unsent[: len(unsent) - stop_prefix_len(unsent, self.params.stop)]
        if whole:
            self.held_text = unsent[len(out) :]
        elif len(out) <= len(self.held_text):
            self.held_text = self.held_text[len(out) :]
        else:  # went into the uncommitted tail: remember how far
            self.sent_partial += len(out) - len(self.held_text)
            self.held_text = ""
        return out


def decode_step(
    tokenizer: PreTrainedTokenizerBase,
    status: DecodeStatus,
    new_ids: Sequence[int],
    finish: FinishLike | None,
    *,
    final: bool | None = None,
) -> str:
    """One stream's step on its own (the engine's path): push ids, decode, advance."""
    status.push(new_ids)
    context, window = status.windows(finish)
    context_text, window_text = batch_decode(
        tokenizer,
        [context, window],
        skip_special_tokens=status.params.skip_special_tokens,
        spaces_between_special_tokens=status.params.spaces_between_special_tokens,
    )
    return status.advance(context_text, window_text, finish, final=final)


class TokenTexts:
    """The text of single token ids (logprob entries), each decoded once and kept.

    Special tokens keep their text (`<|im_end|>`); a byte-fallback token's text is
    U+FFFD, as OpenAI's `token` field shows it. At most one entry per vocabulary id.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._texts: dict[int, str] = {}

    def prepare(self, ids: Iterable[int]) -> None:
        """Decode every id not seen before in one tokenizer call."""
        missing = sorted({i for i in ids if 0 <= i < self.vocab_size and i not in self._texts})
        texts = batch_decode(
            self.tokenizer,
            [[i] for i in missing],
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )
        self._texts.update(zip(missing, texts, strict=True))

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self.prepare((token_id,))
        return self._texts.get(token_id, "")  # "" for an id outside the vocabulary


class StepGaps:
    """The last step number seen per worker, to notice lost step batches."""

    def __init__(self, max_workers: int = 4096) -> None:
        self.max_workers = max_workers
        self._last: OrderedDict[str, int] = OrderedDict()

    def observe(self, worker_id: str, step: int) -> int:
        """How many steps of `worker_id` were skipped before `step`.

        0 for the first batch of a worker, a repeat, or a lower number (a restarted
        worker counts from the start again).
        """
        last = self._last.get(worker_id)
        self._last[worker_id] = step
        self._last.move_to_end(worker_id)
        if len(self._last) > self.max_workers:
            self._last.popitem(last=False)
        if last is None or step <= last:
            return 0
        return step - last - 1


StreamKey = tuple[str, int]  # (rid, choice index)


@dataclass(frozen=True)
class LostStream:
    """A request with an output stream whose tokens did not all arrive (a step batch
    was lost, the detokenizer restarted, or its decoding state was evicted) and whose
    history no worker sent in time. Its text would have a hole, so it is failed."""

    rid: str
    gateway_id: str


@dataclass(frozen=True)
class _Awaiting:
    gateway_id: str
    deadline: float  # on the detokenizer's clock


class IncrementalDetokenizer:
    """Per-request decoding state for every live stream, bounded as an LRU.

    A stream's state goes when its finish arrives; one whose finish is lost (a
    crashed worker) is evicted, oldest first, once `max_requests` streams are live.

    Each output's `completion_tokens` (the worker's total so far) must continue from
    the tokens this stream has received. One that skips ahead (or a request never seen
    that is mid-way) gets no delta: its rid goes to `take_resyncs()`, its outputs
    (every choice) are dropped until its history arrives in a batch's `resent`, which
    rebuilds every choice from the start. Without one within `resync_timeout_s` the
    request goes to `take_lost()`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        *,
        resync_timeout_s: float = RESYNC_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if not resync_timeout_s > 0:
            raise ValueError(f"resync_timeout_s must be > 0, got {resync_timeout_s}")
        self.tokenizer = tokenizer
        self.max_requests = max_requests
        self.resync_timeout_s = resync_timeout_s
        self.clock = clock
        self.vocab_size = len(tokenizer)
        self.token_texts = TokenTexts(tokenizer, self.vocab_size)
        self.evicted = 0  # streams dropped unfinished (a lost finish, or too many live)
        self._streams: OrderedDict[StreamKey, DecodeStatus] = OrderedDict()
        self._failed: OrderedDict[str, None] = OrderedDict()  # rids failed for lost tokens
        self._lost: list[LostStream] = []
        self._resumable: OrderedDict[str, None] = OrderedDict()  # rids whose deltas are logged
        self._awaiting: OrderedDict[str, _Awaiting] = OrderedDict()  # rids whose history is due
        self._to_ask: list[str] = []

    def __len__(self) -> int:
        return len(self._streams)

    def status(self, rid: str, index: int = 0) -> DecodeStatus | None:
        return self._streams.get((rid, index))

    def resumable(self, rid: str) -> bool:
        """Whether the request asked for its deltas to be kept (DetokParams.resumable)."""
        return rid in self._resumable

    def process(self, batch: StepOutputBatch) -> dict[str, list[TextDelta]]:
        """One step of every request: the text deltas, grouped by gateway id.

        Every `StepOutput` of a stream that goes on gives exactly one `TextDelta` (it may
        carry ids and counters with no text yet). The `resent` histories come first:
        each rebuilds its choice from the start (its delta is marked `resent`).
        """
        self.token_texts.prepare(
            token_id
            for outputs in (batch.resent, batch.outputs)
            for out in outputs
            if out.token_logprobs is not None
            for token_id in _logprob_ids(out)
        )
        deltas: dict[str, list[TextDelta]] = {}
        if batch.resent:
            for out in batch.resent:
                if out.rid not in self._failed:  # decoded from scratch, as new
                    self._streams.pop((out.rid, out.index), None)
                    self._awaiting.pop(out.rid, None)
            self._run(batch.resent, batch.worker_id, deltas, resent=True)
        self._run(batch.outputs, batch.worker_id, deltas)
        self.expire()
        return deltas

    def take_lost(self) -> list[LostStream]:
        """Requests failed for lost tokens since the last call (each once)."""
        lost, self._lost = self._lost, []
        return lost

    def take_resyncs(self) -> list[str]:
        """Rids whose history to ask the workers for (`DetokResync`), since the last call."""
        rids, self._to_ask = self._to_ask, []
        return rids

    def expire(self) -> None:
        """Fail the requests whose history did not come within `resync_timeout_s`."""
        now = self.clock()
        while self._awaiting:
            rid, awaiting = next(iter(self._awaiting.items()))
            if awaiting.deadline > now:
                return
            del self._awaiting[rid]
            log.warning("no worker sent the request's history: failing it", extra={"rid": rid})
            self._fail(rid, awaiting.gateway_id)

    # -- internals --------------------------------------------------------------
    def _run(
        self,
        outputs: list[StepOutput],
        worker_id: str,
        deltas: dict[str, list[TextDelta]],
        *,
        resent: bool = False,
    ) -> None:
        for round_outputs in _rounds(outputs):
            going_on = [c for out in round_outputs if (c := self._continuing(out)) is not None]
            # A later choice of the same request may have stopped it after an earlier one
            # passed: none of its choices goes on.
            going_on = [
                out
                for out in going_on
                if out.rid not in self._failed and out.rid not in self._awaiting
            ]
            for out, (text, offset) in zip(going_on, self._decode(going_on), strict=True):
                delta = self._delta(out, text, offset, worker_id if out.detok else "", resent)
                deltas.setdefault(out.gateway_id, []).append(delta)

    def _continuing(self, out: StepOutput) -> StepOutput | None:
        """`out` as it follows what its stream has received, or None. A request re-routed
        to another worker (its first died) may repeat tokens this stream has: the same
        ones (greedy and seeded requests repeat them) are cut off. One that skips ahead,
        or repeats others, waits for its history (every choice)."""
        if out.rid in self._failed or out.rid in self._awaiting:
            return None
        status = self._streams.get((out.rid, out.index))
        received = 0 if status is None else status.tokens
        new = num_tokens(out.new_token_ids)
        sent_before = out.completion_tokens - new
        if sent_before == received:
            return out
        if status is not None and sent_before < received <= out.completion_tokens:
            repeated = unpack_tokens(out.new_token_ids)[: received - sent_before]
            if len(status.ids) == received and status.ids[sent_before:] == repeated:
                return _without_first(out, len(repeated))
        log.info(
            "choice %d: %d tokens received, the worker had sent %d; asking for its history",
            out.index,
            received,
            sent_before,
            extra={"rid": out.rid},
        )
        self._drop_streams(out.rid)
        self._awaiting[out.rid] = _Awaiting(out.gateway_id, self.clock() + self.resync_timeout_s)
        self._to_ask.append(out.rid)
        if len(self._awaiting) > self.max_requests:
            rid, oldest = self._awaiting.popitem(last=False)
            self._fail(rid, oldest.gateway_id)
        return None

    def _drop_streams(self, rid: str) -> None:
        for key in [key for key in self._streams if key[0] == rid]:
            del self._streams[key]

    def _fail(self, rid: str, gateway_id: str) -> None:
        self._drop_streams(rid)
        self._failed[rid] = None
        if len(self._failed) > self.max_requests:
            self._failed.popitem(last=False)
        self._lost.append(LostStream(rid, gateway_id))

    def _decode(self, outputs: list[StepOutput]) -> list[tuple[str, int]]:
        """Each stream's new text and its text_offset."""
        # Each stream (unique within `outputs`) advances with one batch_decode per option set.
        statuses = [self._open(out) for out in outputs]
        windows = [s.windows(out.finish_reason) for s, out in zip(statuses, outputs, strict=True)]
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, status in enumerate(statuses):
            key = (status.params.skip_special_tokens, status.params.spaces_between_special_tokens)
            groups.setdefault(key, []).append(i)
        decoded = [("", "")] * len(outputs)
        for (skip, spaces), members in groups.items():
            texts = batch_decode(
                self.tokenizer,
                [ids for i in members for ids in windows[i]],
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            for j, i in enumerate(members):
                decoded[i] = (texts[2 * j], texts[2 * j + 1])
        results = []
        for out, status, (context_text, window_text) in zip(
            outputs, statuses, decoded, strict=True
        ):
            text = status.advance(context_text, window_text, out.finish_reason)
            results.append((text, status.text_sent))
            status.text_sent += len(text)
            if status.finished:
                self._streams.pop((out.rid, out.index), None)
        return results

    def _open(self, out: StepOutput) -> DecodeStatus:
        """The stream's status (created on its first output), with the new ids pushed."""
        key = (out.rid, out.index)
        status = self._streams.get(key)
        if status is None:
            status = DecodeStatus(params=out.detok or DetokParams())
            self._streams[key] = status
            self._evict()
        else:
            self._streams.move_to_end(key)
            if out.detok is not None:  # sent again after a re-route
                status.params = out.detok
        if out.detok is not None and out.detok.resumable:
            self._resumable[out.rid] = None
            if len(self._resumable) > self.max_requests:
                self._resumable.popitem(last=False)
        status.tokens += num_tokens(out.new_token_ids)
        status.push(self._valid_ids(out))
        return status

    def _evict(self) -> None:
        while len(self._streams) > self.max_requests:
            (rid, index), _ = self._streams.popitem(last=False)
            self.evicted += 1
            log.warning(
                "dropped the decoding state of an unfinished request (choice %d): more than "
                "%d live streams",
                index,
                self.max_requests,
                extra={"rid": rid},
            )

    def _valid_ids(self, out: StepOutput) -> list[int]:
        ids = out.new_token_ids_list
        valid = [i for i in ids if 0 <= i < self.vocab_size]
        if len(valid) != len(ids):
            log.warning(
                "ignored %d token id(s) outside the vocabulary [0, %d)",
                len(ids) - len(valid),
                self.vocab_size,
                extra={"rid": out.rid},
            )
        return valid

    def _delta(
        self, out: StepOutput, text: str, text_offset: int, worker_id: str, resent: bool
    ) -> TextDelta:
        return TextDelta(
            worker_id=worker_id,
            rid=out.rid,
            text=text,
            token_ids=out.new_token_ids,
            text_offset=text_offset,
            token_offset=max(out.completion_tokens - num_tokens(out.new_token_ids), 0),
            resent=resent,
            index=out.index,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=self._logprobs(out),
            prompt_logprobs=self._prompt_logprobs(out.prompt_logprobs),
        )

    def _prompt_logprobs(self, prompt: PromptLogprobs | None) -> PromptLogprobEntries | None:
        if prompt is None:
            return None
        entries = self._entries(
            prompt.token_ids_list,
            prompt.logprobs,
            list(prompt.top) if prompt.top else [None] * len(prompt.logprobs),
        )
        head = None
        if prompt.head_token_id >= 0:
            t = prompt.head_token_id
            head = LogprobEntry(token_id=t, token=self.token_texts.text(t), logprob=0.0)
        return PromptLogprobEntries(entries=entries, head=head)

    def _logprobs(self, out: StepOutput) -> list[LogprobEntry] | None:
        if out.token_logprobs is None:
            return None
        tops: list[TopLogprobs | None] = (
            list(out.top_logprobs) if out.top_logprobs else [None] * len(out.token_logprobs)
        )
        return self._entries(out.new_token_ids_list, out.token_logprobs, tops)

    def _entries(
        self, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs | None]
    ) -> list[LogprobEntry]:
        entries = []
        for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True):
            candidates = []
            if top is not None:
                candidates = [
                    TopLogprobEntry(token_id=t, token=self.token_texts.text(t), logprob=lp)
                    for t, lp in zip(top.token_ids_list, top.logprobs, strict=True)
                ]
            entries.append(
                LogprobEntry(
                    token_id=token_id,
                    token=self.token_texts.text(token_id),
                    logprob=logprob,
                    top=candidates,
                )
            )
        return entries


def _logprob_ids(out: StepOutput) -> Iterator[int]:
    yield from out.new_token_ids_list
    for top in out.top_logprobs or ():
        yield from top.token_ids_list
    prompt = out.prompt_logprobs
    if prompt is not None:
        yield from prompt.token_ids_list
        for top in prompt.top or ():
            yield from top.token_ids_list


def _rounds(outputs: list[StepOutput]) -> Iterator[list[StepOutput]]:
    """Split a batch so no stream appears twice in one decode round (in order)."""
    current: list[StepOutput] = []
    seen: set[StreamKey] = set()
    for out in outputs:
        key = (out.rid, out.index)
        if key in seen:
            yield current
            current, seen = [], set()
        current.append(out)
        seen.add(key)
    if current:
        yield current


def _without_first(out: StepOutput, count: int) -> StepOutput:
    """`out` without its first `count` new tokens (and their logprobs)."""
    return msgspec.structs.replace(
        out,
        new_token_ids=out.new_token_ids[4 * count :],
        token_logprobs=None if out.token_logprobs is None else out.token_logprobs[count:],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[count:],
    )
