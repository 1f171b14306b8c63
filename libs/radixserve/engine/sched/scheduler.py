"""The per-iteration batch scheduler: one `step()` = plan, launch, read tokens, bookkeeping.

Each step: make room for every running request's next token (retracting if the
pool is short), admit waiting requests through the prefill adder (the request
mid-chunk first, then in the order of sched/policy.py: priority, then the schedule
policy; admission only, nothing running is preempted), launch one forward over
decode and prefill requests together (mixed batch) and the sampling of the requests
whose prompt is fully in KV, then read the sampled tokens and finish or continue
each request. With overlap scheduling (sched/overlap.py) the tokens read are the
previous step's, while the device runs this one.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import jump_forward, sample_with_grammar
from radixserve.engine.forward_batch import ForwardBatch, SharedPrefix
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.request import FinishReason, Req, ReqStatus, TokenLogprob
from radixserve.engine.sampling.batch import SamplingBatch
from radixserve.engine.sampling.penalty_state import PenaltyState
from radixserve.engine.sched.batch_builder import build_forward_batch
from radixserve.engine.sched.decode import ensure_decode_memory, retract
from radixserve.engine.sched.finish import Detokenize, check_finished
from radixserve.engine.sched.input_logprobs import assign_input_logprobs, plan_input_logprobs
from radixserve.engine.sched.kv_manager import KVManager, KVUsage
from radixserve.engine.sched.overlap import Launched, needs_exact_state, resolve_future_inputs
from radixserve.engine.sched.policy import order_waiting
from radixserve.engine.sched.prefill import AddResult, PrefillAdder, future_tokens, has_free_row
from radixserve.engine.sched.shared_prefix import find_shared_prefixes
from radixserve.engine.transfer import HostCopy, upload_int64

# Requests passed over in one step for sharing a prefix admitted in it; past this the
# step stops admitting (scanning a long queue of one group would cost host time).
MAX_DEFERRED_PER_STEP = 128


class Runner(Protocol):
    device: torch.device
    vocab_size: int
    max_running_requests: int  # the config's, resolved for the device

    def uses_cascade(self, batch_size: int, mixed: bool = False) -> bool: ...

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # The starvation bound's clock (seconds): stamps arrivals and each step's `now`.
        self.clock = clock
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
        # Overlap scheduling: on CUDA unless disabled (tests may set it on the CPU).
        self.overlap = not config.disable_overlap_schedule and runner.device.type == "cuda"
        self._inflight: Launched | None = None  # launched, tokens not read yet
        # Penalized requests' seen tokens and output counts, updated on the device.
        self.penalty_state = PenaltyState(
            runner.vocab_size, runner.device, runner.max_running_requests
        )
        # Counters tests and metrics read.
        self.total_prefill_tokens = 0
        self.total_decode_tokens = 0  # decode rows run (one token each)
        self.total_cached_tokens = 0
        self.total_retractions = 0
        self.total_cascade_steps = 0  # decode steps run with shared prefixes
        self.total_exact_state_waits = 0  # steps that read the step in flight before planning
        self.total_device_wait_s = 0.0  # the host's time blocked on launched steps' tokens
        # The last cascade groups and the decoding requests they were found for: a decode
        # batch keeps its members for many steps, and their prefixes stay locked (same
        # slots) while they run, so the groups hold until the membership changes. Every
        # launched step updates or drops it; a request leaves the decode rows for at
        # least one such step (its prefill) before it could come back with other slots.
        self._groups_for: tuple[tuple[str, ...], tuple[SharedPrefix, ...]] = ((), ())

    # -- requests ---------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request. One that carries an `arrival_time` already keeps it (the n
        choices of one prompt, queued after their shared prefill, wait since the prompt)."""
        if req.arrival_time is None:
            req.arrival_time = self.clock()
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
        return bool(self.waiting or self.running or self.chunked or self._pending or self._inflight)

    def holders(self) -> list[Req]:
        """Requests that hold KV slots now."""
        return [*self.running, *([self.chunked] if self.chunked else [])]

    def usage(self) -> KVUsage:
        return self.kv.usage(self.holders())

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.holders())
        self.penalty_state.check(self.running)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when idle (running requests hold cached prefixes)."""
        if self.running or self.chunked or self._inflight:
            return False
        self.kv.cache.reset()
        self.kv.kv_pool.clear()
        self.kv.req_pool.clear()
        return True

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        return self.step_at(self.clock())

    def step_at(self, now: float) -> list[StepOutput]:
        """A step whose admission compares waits against `now` (a reading of the clock):
        a replica (a tensor-parallel rank) is given rank 0's, so that it admits alike."""
        outputs = self._step(now)
        if self.config.debug_check_invariants:
            self.check_invariants()
        return outputs

    def _step(self, now: float) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        if self._inflight is not None and any(needs_exact_state(r) for r in self.running):
            self.total_exact_state_waits += 1
            outputs.extend(self._drain())
        decode_reqs = self._plan_decode(outputs)
        prefill_reqs = self._plan_prefill(decode_reqs, now)
        if prefill_reqs and not self.config.enable_mixed_chunk and decode_reqs:
            # Prefill-first without mixing: the decoders give their slot back and wait a step.
            for req in decode_reqs:
                self._unassign_one(req)
            decode_reqs = []
        batch_reqs = decode_reqs + prefill_reqs
        if not batch_reqs:
            if self._inflight is not None:  # plan again once its tokens are known
                outputs.extend(self._drain())
                return outputs
            if self.waiting and not self.running and self.chunked is None:
                # Nothing runs, so nothing will free memory: the first request in admission
                # order (the one the adder refused alone) can never fit.
                req = self._ordered_waiting(now)[0]
                self.waiting.remove(req)
                outputs.append(
                    self._finish(
                        req, FinishReason("abort", message="KV cache too small for this request")
                    )
                )
            return outputs
        self.total_prefill_tokens += sum(r.extend_len for r in prefill_reqs)
        self.total_decode_tokens += len(decode_reqs)
        launched = self._launch(batch_reqs)
        # The previous step's tokens, read while the device runs this one.
        outputs.extend(self._drain())
        if self.overlap:
            self._inflight = launched
        else:
            outputs.extend(self._read(launched))
        if decode_reqs and not prefill_reqs:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
        return outputs

    def _drain(self) -> list[StepOutput]:
        """Read the tokens of the step in flight, if any."""
        launched, self._inflight = self._inflight, None
        return [] if launched is None else self._read(launched)

    def _plan_decode(self, outputs: list[StepOutput]) -> list[Req]:
        if not self.running:
            return []
        # Requests whose pending token is their last (length or context limit) wait for
        # it to be read; they are not decoded again.
        finishing = [
            r for r in self.running if r.remaining_new_tokens == 0 or r.seq_len >= self.context_len
        ]
        decoding = [r for r in self.running if r not in finishing] if finishing else self.running
        if self._inflight is not None and self.kv.available_tokens() < self.kv.decode_slots_needed(
            decoding
        ):
            # Retraction needs every token on the host: read the step in flight first.
            outputs.extend(self._drain())
            return self._plan_decode(outputs)
        memory = ensure_decode_memory(self.kv, decoding, self.chunked)
        if self.chunked is not None and self.chunked in memory.retracted:
            self.chunked = None
        for req in reversed(memory.retracted):
            self.penalty_state.release(req)  # rebuilt from the token lists when sampled again
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
        self.running = memory.keep + finishing
        for req in memory.keep:
            req.extend_len = 1
        self.kv.assign_decode_slots(memory.keep)  # one allocation and upload for all
        return list(memory.keep)

    def _unassign_one(self, req: Req) -> None:
        self.kv.unassign_new_slots(req, 1)
        req.extend_len = 0

    def _plan_prefill(self, decode_reqs: list[Req], now: float) -> list[Req]:
        if not self.waiting and self.chunked is None:
            return []
        if self.chunked is None and not has_free_row(
            self.kv, len(self.running), self.runner.max_running_requests
        ):
            return []  # nothing could be admitted: skip the adder's setup
        chunk = self.config.chunked_prefill_size
        adder = PrefillAdder(
            kv=self.kv,
            reserved_tokens=sum(
                future_tokens(r, self.new_token_ratio, self.kv.page_size) for r in decode_reqs
            ),
            rem_input_tokens=self.config.max_prefill_tokens,
            rem_chunk_tokens=chunk if chunk > 0 else -1,
            new_token_ratio=self.new_token_ratio,
            max_running=self.runner.max_running_requests,
            num_running=len(self.running),
        )
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        deferred = 0
        for req in self._ordered_waiting(now):
            result = adder.add_one(req)
            if result is AddResult.DEFERRED and deferred < MAX_DEFERRED_PER_STEP:
                deferred += 1  # waits for a prefix admitted this step to be cached
                continue
            if result is not AddResult.ADDED:
                break
            self.waiting.remove(req)
        self.chunked = adder.chunked
        return adder.admitted

    def _ordered_waiting(self, now: float) -> list[Req]:
        config = self.config
        return order_waiting(
            config.schedule_policy,
            list(self.waiting),
            self.kv,
            config.lpm_max_waiting,
            now,
            config.priority_starvation_s,
        )

    def _launch(self, reqs: list[Req]) -> Launched:
        """Queue the forward and the sampling of the ready requests; nothing waits for the
        device. Prompts whose prefill completes (or a chunk of one) go into the cache."""
        device = self.runner.device
        batch = build_forward_batch(
            reqs, self.kv.kv_pool, self.kv.req_pool, device, self._shared_prefixes(reqs)
        )
        if any(r.num_pending for r in reqs):
            assert self._inflight is not None and self._inflight.next_ids is not None
            resolve_future_inputs(batch.input_ids, self._inflight.next_ids)
        plan = plan_input_logprobs(reqs)
        if plan is not None:
            batch.logprob_rows = upload_int64(plan.rows, device)
            batch.logprob_targets = upload_int64(plan.targets, device)
            batch.logprob_top = plan.top
        logits = self.runner.forward(batch)
        scored = None
        if plan is not None:
            assert batch.input_logprobs is not None
            scored = (plan, HostCopy(list(batch.input_logprobs)))
        for req in reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
        ready = [i for i, r in enumerate(reqs) if r.kv_len == r.seq_len]
        for req in reqs:
            # Mid-chunk, and once its prefill completes: the prompt's KV goes into the
            # cache now (not when the request ends), so requests that arrive while it
            # decodes share the prefix instead of computing it again.
            if req.kv_len < req.seq_len or not req.prefill_done:
                self.kv.cache_unfinished(req)
        if not ready:
            return Launched([], [], None, None, scored)
        ready_reqs = [reqs[i] for i in ready]
        sampling = SamplingBatch.build(
            ready_reqs, self.runner.vocab_size, logits.device, self.penalty_state
        )
        rows = logits if len(ready) == len(reqs) else logits[upload_int64(ready, logits.device)]
        # Constrained rows get their grammar's token mask first (engine/constrained).
        result = sample_with_grammar(rows, sampling, ready_reqs)
        self.penalty_state.accept(sampling.penalties, result.next_token_ids)
        takes_token = []
        for row, req in enumerate(ready_reqs):
            if not req.prefill_done:
                req.prefill_done = True
                self.total_cached_tokens += req.cached_tokens if req.num_retractions == 0 else 0
                if req not in self.running:
                    self.running.append(req)
            takes = req.remaining_new_tokens > 0  # not a prefill-only request (n > 1)
            if takes:
                req.num_pending += 1
                req.future_row = row
            takes_token.append(takes)
        host = HostCopy(
            [
                result.next_token_ids,
                result.logprobs,
                result.top_logprob_ids,
                result.top_logprob_values,
            ]
        )
        return Launched(ready_reqs, takes_token, result.next_token_ids, host, scored)

    def _shared_prefixes(self, reqs: list[Req]) -> tuple[SharedPrefix, ...]:
        """Groups for cascade attention among the step's leading decoding requests (all
        of a decode step; those before the prefills of a mixed one), where the runner
        uses it."""
        decoding = next(
            (i for i, r in enumerate(reqs) if r.extend_len != 1 or not r.prefill_done), len(reqs)
        )
        mixed = decoding < len(reqs)
        if decoding < 2 or not self.runner.uses_cascade(len(reqs), mixed):
            # Kept only from one searched step to the next: a request that left the
            # decode rows (retracted, say) and came back with other slots is searched.
            self._groups_for = ((), ())
            return ()
        members = tuple(r.rid for r in reqs[:decoding])
        if self._groups_for[0] == members:
            groups = self._groups_for[1]
        else:
            paths = [self.kv.cache.path(r.last_node) for r in reqs[:decoding]]
            groups = find_shared_prefixes(paths)
            self._groups_for = (members, groups)
        if not groups:
            return ()
        self.total_cascade_steps += 1
        return groups

    def _wait(self, copies: HostCopy) -> list[torch.Tensor | None]:
        """A launched step's host copies, once the device has made them (timed)."""
        started = time.perf_counter()
        host = copies.wait()
        self.total_device_wait_s += time.perf_counter() - started
        return host

    def _read(self, launched: Launched) -> list[StepOutput]:
        """Read a launched step's tokens (waiting for them alone) and finish or continue
        each request that sampled."""
        outputs: list[StepOutput] = []
        if launched.scored is not None:
            plan, copies = launched.scored
            chosen, top_ids, top_values = self._wait(copies)
            assert chosen is not None
            assign_input_logprobs(plan, chosen, top_ids, top_values)
        if launched.host is None:
            return outputs
        ids, logprobs, top_ids, top_values = self._wait(launched.host)
        assert ids is not None
        next_ids = ids.tolist()
        for row, (req, token) in enumerate(zip(launched.ready, next_ids, strict=True)):
            if req.finished:
                continue  # aborted, or stopped on the token before: this one is dropped
            if not launched.takes_token[row]:  # prefill-only (n > 1 parents)
                outputs.append(self._finish_running(req, FinishReason("length")))
                continue
            req.num_pending -= 1
            if req.grammar is not None and not req.grammar.accept(token):
                # Only when the mask admitted nothing (a complete grammar whose stop token
                # min_new_tokens forbids): end the request rather than emit a bad token.
                outputs.append(self._finish_running(req, FinishReason("stop")))
                continue
            req.output_ids.append(token)
            new_logprobs = self._logprobs(req, row, token, logprobs, top_ids, top_values)
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
                self.penalty_state.release(req)  # the forced tokens are on the host only
                self.waiting.appendleft(req)

    @staticmethod
    def _logprobs(
        req: Req,
        row: int,
        token: int,
        logprobs: torch.Tensor | None,
        top_ids: torch.Tensor | None,
        top_values: torch.Tensor | None,
    ) -> list[TokenLogprob]:
        """The row's logprobs, from the host copies of the sampler's results."""
        if not req.params.return_logprob or logprobs is None:
            return []
        entry = TokenLogprob(token_id=token, logprob=float(logprobs[row]))
        k = req.params.top_logprobs_num
        if k > 0 and top_ids is not None and top_values is not None:
            ids = top_ids[row, :k].tolist()
            values = top_values[row, :k].tolist()
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
        req.num_pending = 0  # a token still on the device is dropped
        self.kv.release(req)
        self.penalty_state.release(req)
        return StepOutput(req, [])
