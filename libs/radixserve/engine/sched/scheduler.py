"""The per-iteration batch scheduler: one `step()` = plan, forward, sample, bookkeeping.

Each step: make room for every running request's next token (retracting if the
pool is short), admit waiting requests through the prefill adder (the request
mid-chunk first), run one forward over decode and prefill requests together
(mixed batch), sample the requests whose prompt is fully in KV, and finish or
continue each one.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import jump_forward, sample_with_grammar
from radixserve.engine.forward_batch import ForwardBatch
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import FinishReason, Req, ReqStatus, TokenLogprob
from radixserve.engine.sampling.batch import SamplingBatch
from radixserve.engine.sampling.sampler import SampleResult
from radixserve.engine.sched.batch_builder import build_forward_batch
from radixserve.engine.sched.decode import ensure_decode_memory, retract
from radixserve.engine.sched.finish import Detokenize, check_finished
from radixserve.engine.sched.kv_manager import KVManager, KVUsage
from radixserve.engine.sched.policy import order_waiting
from radixserve.engine.sched.prefill import AddResult, PrefillAdder, future_tokens


class Runner(Protocol):
    device: torch.device
    vocab_size: int

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass
class StepOutput:
    """What one request produced in one step (new tokens may be empty: abort, prefill-only)."""

    req: Req
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.req.finished


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        cache: PrefixCache,
        context_len: int,
        detokenize: Detokenize | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv = KVManager(kv_pool, req_pool, cache)
        self.context_len = context_len
        self.detokenize = detokenize
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefill done, decoding
        self.chunked: Req | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self._arrivals = itertools.count()
        self._pending: list[StepOutput] = []  # aborts and rejections to report on next step
        # Counters tests and metrics read.
        self.total_prefill_tokens = 0
        self.total_cached_tokens = 0
        self.total_retractions = 0

    # -- requests ---------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.arrival_order = next(self._arrivals)
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Abort a waiting or running request; its KV is returned at once."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._pending.append(self._finish(req, FinishReason("abort", message="aborted")))
                return True
        for req in [*self.running, *([self.chunked] if self.chunked else [])]:
            if req.rid == rid:
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(req)
                self._pending.append(self._finish(req, FinishReason("abort", message="aborted")))
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._pending)

    def holders(self) -> list[Req]:
        """Requests that hold KV slots now."""
        return [*self.running, *([self.chunked] if self.chunked else [])]

    def usage(self) -> KVUsage:
        return self.kv.usage(self.holders())

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.holders())

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when idle (running requests hold cached prefixes)."""
        if self.running or self.chunked:
            return False
        self.kv.cache.reset()
        self.kv.kv_pool.clear()
        self.kv.req_pool.clear()
        return True

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._step()
        if self.config.debug_check_invariants:
            self.check_invariants()
        return outputs

    def _step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        decode_reqs = self._plan_decode(outputs)
        prefill_reqs = self._plan_prefill(decode_reqs)
        if prefill_reqs and not self.config.enable_mixed_chunk and decode_reqs:
            # Prefill-first without mixing: the decoders give their slot back and wait a step.
            for req in decode_reqs:
                self._unassign_one(req)
            decode_reqs = []
        batch_reqs = decode_reqs + prefill_reqs
        if not batch_reqs:
            if self.waiting and not self.running and self.chunked is None:
                # Nothing runs, so nothing will free memory: the head request can never fit.
                req = self.waiting.popleft()
                outputs.append(
                    self._finish(
                        req, FinishReason("abort", message="KV cache too small for this request")
                    )
                )
            return outputs
        self.total_prefill_tokens += sum(r.extend_len for r in prefill_reqs)
        logits = self._forward(batch_reqs)
        outputs.extend(self._process(batch_reqs, logits))
        if decode_reqs and not prefill_reqs:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
        return outputs

    def _plan_decode(self, outputs: list[StepOutput]) -> list[Req]:
        if not self.running:
            return []
        memory = ensure_decode_memory(self.kv, self.running, self.chunked)
        if self.chunked is not None and self.chunked in memory.retracted:
            self.chunked = None
        for req in reversed(memory.retracted):
            self.waiting.appendleft(req)
        if memory.retracted:
            self.total_retractions += len(memory.retracted)
            self.new_token_ratio = 1.0  # we were too optimistic: reserve fully for a while
        for req in memory.unservable:
            outputs.append(
                self._finish(
                    req, FinishReason("abort", message="KV cache too small for this request")
                )
            )
        self.running = memory.keep
        for req in self.running:
            req.extend_len = 1
        self.kv.assign_decode_slots(self.running)  # one allocation and upload for all
        return list(self.running)

    def _unassign_one(self, req: Req) -> None:
        self.kv.unassign_new_slots(req, 1)
        req.extend_len = 0

    def _plan_prefill(self, decode_reqs: list[Req]) -> list[Req]:
        if not self.waiting and self.chunked is None:
            return []
        chunk = self.config.chunked_prefill_size
        adder = PrefillAdder(
            kv=self.kv,
            reserved_tokens=sum(
                future_tokens(r, self.new_token_ratio, self.kv.page_size) for r in decode_reqs
            ),
            rem_input_tokens=self.config.max_prefill_tokens,
            rem_chunk_tokens=chunk if chunk > 0 else -1,
            new_token_ratio=self.new_token_ratio,
            max_running=self.config.max_running_requests,
            num_running=len(self.running),
        )
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        ordered = order_waiting(
            self.config.schedule_policy, list(self.waiting), self.kv, self.config.lpm_max_waiting
        )
        for req in ordered:
            if adder.add_one(req) is not AddResult.ADDED:
                break
            self.waiting.remove(req)
        self.chunked = adder.chunked
        return adder.admitted

    def _forward(self, reqs: list[Req]) -> torch.Tensor:
        batch = build_forward_batch(reqs, self.kv.kv_pool, self.kv.req_pool, self.runner.device)
        logits = self.runner.forward(batch)
        for req in reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
        return logits

    def _process(self, reqs: list[Req], logits: torch.Tensor) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        ready = [i for i, r in enumerate(reqs) if r.kv_len == r.seq_len]
        for req in reqs:
            # Mid-chunk, and once its prefill completes: the prompt's KV goes into the
            # cache now (not when the request ends), so requests that arrive while it
            # decodes share the prefix instead of computing it again.
            if req.kv_len < req.seq_len or not req.prefill_done:
                self.kv.cache_unfinished(req)
        if not ready:
            return outputs
        ready_reqs = [reqs[i] for i in ready]
        sampling = SamplingBatch.build(ready_reqs, self.runner.vocab_size, logits.device)
        # Constrained rows get their grammar's token mask first (engine/constrained).
        result = sample_with_grammar(logits[ready], sampling, ready_reqs)
        next_ids = result.next_token_ids.tolist()
        for row, (req, token) in enumerate(zip(ready_reqs, next_ids, strict=True)):
            if not req.prefill_done:
                req.prefill_done = True
                self.total_cached_tokens += req.cached_tokens if req.num_retractions == 0 else 0
                if req not in self.running:
                    self.running.append(req)
            if req.remaining_new_tokens == 0:  # prefill-only (n > 1 parents)
                outputs.append(self._finish_running(req, FinishReason("length")))
                continue
            if req.grammar is not None and not req.grammar.accept(token):
                # Only when the mask admitted nothing (a complete grammar whose stop token
                # min_new_tokens forbids): end the request rather than emit a bad token.
                outputs.append(self._finish_running(req, FinishReason("stop")))
                continue
            req.output_ids.append(token)
            new_logprobs = self._logprobs(req, result, row, token)
            reason = check_finished(req, self.context_len, self.detokenize)
            if reason is not None:
                out = self._finish_running(req, reason)
                out.new_token_ids, out.new_logprobs = [token], new_logprobs
                outputs.append(out)
            else:
                outputs.append(StepOutput(req, [token], new_logprobs))
        self._jump_forward(outputs)
        return outputs

    def _jump_forward(self, outputs: list[StepOutput]) -> None:
        """Structured outputs: append the text a grammar forces (engine/constrained). The
        request gives its KV to the cache and re-enters through prefill, where one extend
        computes the forced tokens instead of a decode step each. Needs a cache that
        keeps prefixes (without one the whole sequence would be recomputed)."""
        if not self.kv.cache.reuses_prefixes:
            return
        for out in outputs:
            req = out.req
            if req.grammar is None or req.finished:
                continue
            forced, reason = jump_forward(req, self.context_len, self.detokenize)
            if not forced:
                continue
            out.new_token_ids.extend(forced)
            if reason is not None:
                self._finish_running(req, reason)
            else:
                self.running.remove(req)
                retract(self.kv, req)
                self.waiting.appendleft(req)

    def _logprobs(self, req: Req, result: SampleResult, row: int, token: int) -> list[TokenLogprob]:
        if not req.params.return_logprob or result.logprobs is None:
            return []
        entry = TokenLogprob(token_id=token, logprob=float(result.logprobs[row]))
        k = req.params.top_logprobs_num
        if k > 0 and result.top_logprob_ids is not None and result.top_logprob_values is not None:
            ids = result.top_logprob_ids[row, :k].tolist()
            values = result.top_logprob_values[row, :k].tolist()
            entry.top = list(zip(ids, values, strict=True))
        req.logprobs.append(entry)
        return [entry]

    def _finish_running(self, req: Req, reason: FinishReason) -> StepOutput:
        if req in self.running:
            self.running.remove(req)
        return self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> StepOutput:
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
        self.kv.release(req)
        return StepOutput(req, [])
