"""The prefill adder: admits waiting requests into this step until a budget runs out.

Budgets: KV tokens (what is free or evictable, minus what running requests are
expected to still need; new KV is counted in whole pages), prefill tokens per step
(max_prefill_tokens), and the chunk size; a request longer than the remaining chunk
is split, and only one request is ever mid-chunk.

A request whose prompt shares an uncached prefix with one admitted in the same step
waits a step (`DEFERRED`): the other's KV enters the cache when its prefill (or chunk)
runs, and this one then reuses it instead of computing it a second time (SGLang's
in-batch prefix check). Several prompts sharing a new system prompt that arrive
together would otherwise all prefill it in one step when the chunk holds them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.engine.request import Req, ReqStatus
from radixserve.engine.sched.kv_manager import KVManager

# Long max_new_tokens would otherwise reserve the whole pool for one request.
CLIP_MAX_NEW_TOKENS_ESTIMATE = 4096
# Tokens a request must share past its cached prefix with one admitted this step to
# wait for it (SGLang's in-batch threshold); fewer are not worth a step's delay.
IN_BATCH_SHARE_MIN = 32


def future_tokens(req: Req, new_token_ratio: float, page_size: int) -> int:
    """KV a running request is expected to still need: its remaining tokens scaled by the
    new-token ratio, and never less than one page (its next decode step must fit)."""
    expected = int(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATE) * new_token_ratio)
    return max(expected, page_size)


def has_free_row(kv: KVManager, num_running: int, max_running: int) -> bool:
    """Whether one more request may start: under the running limit, with a request row."""
    return num_running < max_running and kv.req_pool.available() > 0


class AddResult(enum.Enum):
    ADDED = 1
    NO_TOKENS = 2  # out of KV or prefill budget: stop admitting this step
    NO_ROWS = 3
    DEFERRED = 4  # shares an uncached prefix with a request admitted this step


@dataclass
class PrefillAdder:
    kv: KVManager
    reserved_tokens: int  # expected future decode tokens of running requests
    rem_input_tokens: int
    rem_chunk_tokens: int  # < 0 means unlimited
    new_token_ratio: float
    max_running: int
    num_running: int
    admitted: list[Req] = field(default_factory=list)
    chunked: Req | None = None  # the request left mid-prefill after this step

    def _rem_kv(self) -> int:
        return self.kv.available_tokens() - self.reserved_tokens

    def _future_tokens(self, req: Req) -> int:
        return future_tokens(req, self.new_token_ratio, self.kv.page_size)

    def _take(self, req: Req, extend_len: int) -> None:
        if self.rem_chunk_tokens >= 0 and extend_len > self.rem_chunk_tokens:
            extend_len = self.rem_chunk_tokens
            self.chunked = req
        req.extend_len = extend_len
        self.kv.assign_new_slots(req, extend_len)
        self.admitted.append(req)
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens >= 0:
            self.rem_chunk_tokens -= extend_len
        self.reserved_tokens += self._future_tokens(req) if self.chunked is not req else 0

    def add_chunked(self, req: Req) -> None:
        """Continue the request that was mid-chunk (it already holds a row and its prefix)."""
        remaining = req.seq_len - req.kv_len
        # Whole pages only: the tail of its last page is free, the rest costs pages.
        budget = min(
            remaining,
            self.kv.max_extend_tokens(req, self._rem_kv()),
            max(self.rem_input_tokens, 1),
        )
        if budget <= 0:
            self.chunked = req  # no memory this step; try again next step
            return
        self._take(req, budget)
        if remaining > budget:
            self.chunked = req

    def add_one(self, req: Req) -> AddResult:
        if self.chunked is not None or self.rem_chunk_tokens == 0:
            return AddResult.NO_TOKENS
        if not has_free_row(self.kv, self.num_running + len(self.admitted), self.max_running):
            return AddResult.NO_ROWS
        prefix_len = self.kv.match(req, load=True)
        if self._shares_uncached_prefix(req, prefix_len):
            return AddResult.DEFERRED
        extend_len = req.seq_len - prefix_len
        if self.admitted and extend_len > self.rem_input_tokens:
            return AddResult.NO_TOKENS
        self.kv.admit(req)  # locks the prefix, so the allocation below cannot evict it
        need = min(extend_len, self.rem_chunk_tokens) if self.rem_chunk_tokens >= 0 else extend_len
        # With nothing else running, the future estimate must not keep a request out.
        alone = self.num_running == 0 and not self.admitted
        future = self._future_tokens(req) if need == extend_len and not alone else 0
        if self.kv.slots_needed(req, need) + future > self._rem_kv():
            self.kv.release(req)
            return AddResult.NO_TOKENS
        req.status = ReqStatus.RUNNING
        if req.num_retractions == 0 and len(req.output_ids) == req.resumed:
            # Prompt tokens the cache served (a resumed request's outputs are not prompt).
            req.cached_tokens = min(prefix_len, len(req.origin_input_ids))
        self._take(req, extend_len)
        return AddResult.ADDED

    def _shares_uncached_prefix(self, req: Req, prefix_len: int) -> bool:
        """Whether a request admitted this step computes at least IN_BATCH_SHARE_MIN (and
        a page) of req's tokens past its cached prefix."""
        if not self.admitted or not self.kv.cache.reuses_prefixes:
            return False
        wanted = prefix_len + max(IN_BATCH_SHARE_MIN, self.kv.page_size)
        ids = req.fill_ids
        if len(ids) <= wanted:
            return False
        # other[:wanted] == ids[:wanted], the short uncached window first: requests over
        # one long cached system prompt differ right after it, so most pairs are told
        # apart without comparing (or copying) the prompt.
        window, cached = ids[prefix_len:wanted], ids[:prefix_len]
        return any(
            other.fill_ids[prefix_len:wanted] == window and other.fill_ids[:prefix_len] == cached
            for other in self.admitted
        )
