"""`Engine`: the in-process API (like `sglang.Engine`) over runner + scheduler.

Two layers:
- the step API a serving loop drives (the worker service): `submit` a request,
  `abort` it, `step()` once per iteration -> the new tokens of every choice that
  produced some or finished; `load()` for stats. Nothing else crosses it, so GPU
  work (overlap scheduling, CUDA graphs) stays behind `step()`.
- the convenience API on top of it: `generate`, `generate_stream`, `chat`.

Calls are synchronous; `generate_stream` runs engine steps in a worker thread so
an asyncio caller stays responsive. One lock serialises steps, so several streams
(and blocking calls from other threads) share one continuous batch.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import GrammarBackend
from radixserve.engine.distributed import (
    SINGLE,
    check_tp_group_free,
    destroy_tp_group,
    free_tcp_address,
    init_tp_group,
)
from radixserve.engine.groups import ChoiceOutput, RequestGroup
from radixserve.engine.heap import settle_started_heap, thaw
from radixserve.engine.kvcache.block_events import BlockEventLog, event_block_size
from radixserve.engine.kvcache.hiradix_cache import HiRadixCache, HostCacheStats
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.outputs import Tracked, final_output, stream_delta
from radixserve.engine.request import FinishReason, Req, ReqStatus
from radixserve.engine.runner import ModelRunner, resolve_device
from radixserve.engine.sampling.params import SamplingParams, resolve_seed
from radixserve.engine.sched.finish import limit_reached
from radixserve.engine.sched.kv_manager import KVUsage
from radixserve.engine.tensor_parallel import (
    OtherRanks,
    RankLost,
    ReplicatedScheduler,
    build_scheduler,
)
from radixserve.engine.token_ids import checked_token_ids
from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer
from radixserve.protocol.kv_events import AllBlocksCleared, KvEvent

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True)
class EngineLoad:
    """What a serving loop reports about the engine (WorkerStats)."""

    num_running_reqs: int
    num_queue_reqs: int
    kv: KVUsage
    # Forward passes so far by kind (runner.FORWARD_PASS_KINDS): totals, not a window.
    forward_passes: dict[str, int] = field(default_factory=dict)
    # Seconds the steps so far spent blocked on the device (a total): the rest of their
    # time was the host's own work.
    device_wait_seconds: float = 0.0
    # HiCache's host tier (totals), None when it is off.
    host_cache: HostCacheStats | None = None


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        torch.manual_seed(self.config.random_seed)
        # Tensor parallel: the other ranks start first, then all join one group.
        self.tp, others = SINGLE, None
        if self.config.tp_size > 1:
            check_tp_group_free()
        try:
            if self.config.tp_size > 1:
                # Enough GPUs, or an error before any rank starts (a rank without its GPU
                # would die after the group formed, leaving rank 0 in a collective).
                device = resolve_device(self.config.device, self.config.tp_size)
                address = free_tcp_address()
                # Watched from here on: a rank that dies (out of memory in its warm-up,
                # say) ends rank 0's collectives, an error now, not a wait without end.
                others = OtherRanks.start(self.config, address)
                self.tp = init_tp_group(
                    0,
                    self.config.tp_size,
                    address,
                    device,
                    self.config.dist_timeout_s,
                    lost=others.exited,
                )
            self.runner = ModelRunner(self.config, self.tp)
            self.tokenizer = load_tokenizer(self.runner.model_path)
        except BaseException as exc:
            lost = others.abandon() if others is not None else None
            destroy_tp_group(self.tp)
            if lost is not None and isinstance(exc, Exception):
                raise RankLost(lost) from exc  # what failed here because a rank was lost
            raise
        self._watch = others.watch if others is not None else None
        self.context_len = self.runner.context_len
        self._kv_events: BlockEventLog | None = None
        detokenize = lambda ids: self._decode(ids, False)  # noqa: E731
        self.scheduler = (
            build_scheduler(
                self.config, self.runner, detokenize, ReplicatedScheduler, others=others
            )
            if others is not None
            else build_scheduler(self.config, self.runner, detokenize)
        )
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        # Structured outputs: grammars for this tokenizer and the model's logits width.
        self.grammars = GrammarBackend(self.tokenizer, self.runner.vocab_size)
        self._lock = threading.RLock()
        self._groups: dict[str, RequestGroup] = {}
        # Req.rid -> (its group, choice index; -1 for the hidden shared prefill)
        self._owner: dict[str, tuple[RequestGroup, int]] = {}
        self._pending: list[ChoiceOutput] = []  # finished outside the scheduler; next step
        self._closed = False
        if not self.config.disable_gc_freeze:
            settle_started_heap()

    # -- the step API -------------------------------------------------------------
    def submit(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        rid: str | None = None,
        grammar: xgr.CompiledGrammar | None = None,
        priority: int = 0,
        resume_ids: Sequence[int] | np.ndarray | None = None,
        resume_choices: Mapping[int, Sequence[int] | np.ndarray] | None = None,
    ) -> str:
        """Queue one prompt (token ids); returns its rid. Raises ValueError for bad input.

        `grammar`: the request's grammar compiled already (the worker loads the grammar
        service's); without it a regex/json_schema/ebnf/structural_tag in the parameters
        is compiled here, blocking the caller. `priority`: a higher one is admitted
        first (sched/policy.py; a running request is never preempted). `resume_ids`:
        the output tokens another worker generated (n == 1): the request continues
        after them as if it had generated them (`Req.resume`); at its length limit it
        finishes at once, with no new tokens. `resume_choices` (any n, at most one of
        the two): the choices still to run, index -> the output tokens it generated on
        another worker (maybe none), each resumed so, with its own seed (seed + index)
        and its index in its outputs; the choices not named finished there and are
        neither run nor reported."""
        (params,) = self._normalize_params(sampling_params, 1)
        ids = checked_token_ids(input_ids, self.runner.vocab_size)
        resume = self._checked_resume(resume_ids, resume_choices, params)
        return self._submit(ids, params, rid, grammar, priority, resume).rid

    def step(self) -> list[ChoiceOutput]:
        """One iteration of continuous batching: the choices that produced tokens or finished."""
        with self._lock:
            self._check_open()
            outputs, self._pending = self._pending, []
            if self.scheduler.has_work():
                for step_out in self.scheduler.step():
                    owner = self._owner.get(step_out.req.rid)
                    if owner is None:  # forgotten by its caller (aborted)
                        continue
                    group, index = owner
                    if index < 0:
                        if step_out.finished:
                            outputs.extend(self._shared_prefill_done(group, step_out.req))
                        continue
                    outputs.append(
                        ChoiceOutput(
                            group.rid,
                            index,
                            step_out.req,
                            step_out.new_token_ids,
                            step_out.new_logprobs,
                        )
                    )
            for out in outputs:
                if out.finished:
                    self._owner.pop(out.req.rid, None)
                    group_of = self._groups.get(out.rid)
                    if group_of is not None and group_of.finished:
                        del self._groups[out.rid]
            return outputs

    def failure(self) -> str | None:
        """Why this engine cannot go on, known without a step: a tensor-parallel rank's
        process gone (what its next step raises as `RankLost`), else None. Lock-free, so
        a watchdog may ask while a step runs."""
        return self._watch.lost if self._watch is not None else None

    def has_work(self) -> bool:
        with self._lock:
            return not self._closed and bool(self._pending or self.scheduler.has_work())

    def abort(self, rid: str) -> bool:
        """Abort every choice of `rid` (and its shared prefill). Its final outputs, with
        finish reason "abort", come from the next `step()`. False if `rid` is unknown."""
        with self._lock:
            group = self._groups.get(rid)
            if group is None:
                return False
            if group.prefill is not None:
                self._owner.pop(group.prefill.rid, None)
                self.scheduler.abort(group.prefill.rid)
                group.prefill = None
            for index, choice in group.indexed():
                if choice.finished:
                    continue
                if not self.scheduler.abort(choice.rid):
                    # Still waiting on the shared prefill: it holds no KV.
                    self._finish_unscheduled(choice, FinishReason("abort", message="aborted"))
                    self._pending.append(ChoiceOutput(rid, index, choice))
            return True

    def forget(self, rid: str) -> None:
        """Stop tracking `rid` (after aborting it): its outputs are dropped from then on."""
        with self._lock:
            group = self._groups.pop(rid, None)
            if group is None:
                return
            for req in [*group.choices, *([group.prefill] if group.prefill else [])]:
                self._owner.pop(req.rid, None)
            self._pending = [o for o in self._pending if o.rid != rid]

    def num_tracked(self) -> int:
        """Requests submitted and not yet reported finished (tests check nothing leaks)."""
        with self._lock:
            return len(self._groups)

    def load(self) -> EngineLoad:
        with self._lock:
            self._check_open()
            return EngineLoad(
                num_running_reqs=len(self.scheduler.holders()),
                num_queue_reqs=len(self.scheduler.waiting),
                kv=self.scheduler.usage(),
                forward_passes=dict(self.runner.forward_passes),
                device_wait_seconds=self.scheduler.total_device_wait_s,
                host_cache=self.host_cache_stats(),
            )

    def host_cache_stats(self) -> HostCacheStats | None:
        cache = self.scheduler.kv.cache
        return cache.host_stats() if isinstance(cache, HiRadixCache) else None

    # -- the convenience API ------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        priority: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation; a list of prompts (or of input_ids lists) gives a list back.
        `priority` (every prompt's): as `submit`'s."""
        self._check_open()
        prompts, batched = self._normalize_prompts(prompt, input_ids)
        params_list = self._normalize_params(sampling_params, len(prompts))
        groups: list[RequestGroup] = []
        try:
            for ids, params in zip(prompts, params_list, strict=True):
                groups.append(self._submit(ids, params, priority=priority))
            while True:
                # Checked under the lock: another thread's step may finish these groups.
                with self._lock:
                    if all(g.finished for g in groups):
                        break
                    if not self.has_work():
                        raise RuntimeError("the engine went idle with requests unfinished")
                    self.step()
        finally:
            for group in groups:
                if not group.finished:
                    self.abort(group.rid)
                self.forget(group.rid)
        outputs = [
            final_output(Tracked(choice, started=group.started), self.tokenizer)
            for group in groups
            for choice in group.choices
        ]
        if batched or len(outputs) > 1:
            return outputs
        return outputs[0]

    async def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields deltas {text, output_ids, finished, meta_info} until the request finishes.
        `priority`: as `submit`'s."""
        self._check_open()
        prompts, batched = self._normalize_prompts(prompt, input_ids)
        if batched:
            raise ValueError("generate_stream takes one prompt")
        params = self._normalize_params(sampling_params, 1)[0]
        if params.n != 1:
            raise ValueError("generate_stream supports n == 1 only")
        group = self._submit(prompts[0], params, priority=priority)
        tracked = Tracked(group.choices[0], started=group.started)
        try:
            while True:
                delta = stream_delta(tracked, self.tokenizer)
                if delta is not None:
                    yield delta
                    if delta["finished"]:
                        return
                elif not await asyncio.to_thread(self._step_if_busy) and not tracked.req.finished:
                    raise RuntimeError("the engine went idle with the request unfinished")
        finally:
            if not group.finished:
                self.abort(group.rid)
            self.forget(group.rid)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: int = 0,
    ) -> dict[str, Any]:
        """One answer to `messages` (OpenAI's chat messages), rendered with the model's
        chat template. With `tools` (OpenAI's function tools, which the model may call
        as it likes) the answer's calls are read back as the gateway reads them:
        `tool_calls` (OpenAI's entries) and `content` (the text beside them) join `text`
        (engine/chat.py). `priority`: as `submit`'s."""
        if not tools:
            ids = apply_chat_template(self.tokenizer, messages)
            out = self.generate(input_ids=ids, sampling_params=sampling_params, priority=priority)
            assert isinstance(out, dict)
            return out
        from radixserve.engine.chat import add_tool_calls, chat_prompt  # prep and api

        ids, params = chat_prompt(self.tokenizer, messages, tools, sampling_params)
        out = self.generate(input_ids=ids, sampling_params=params, priority=priority)
        assert isinstance(out, dict)
        add_tool_calls(out, tools)
        return out

    # -- KV events: the prefix cache's changes, for cache-aware routing -----------------
    def enable_kv_events(self) -> int:
        """Record the prefix cache's changes as KV events from now on (before the first
        request); returns the events' block size in tokens."""
        with self._lock:
            self._check_open()
            if self._kv_events is None:
                log = BlockEventLog(event_block_size(self.config.page_size))
                if isinstance(self.scheduler.kv.cache, RadixCache):
                    self.scheduler.kv.cache.enable_events(log)
                self._kv_events = log
            return self._kv_events.block_size

    def drain_kv_events(self) -> list[KvEvent]:
        """The events since the last drain (none unless `enable_kv_events` was called)."""
        with self._lock:
            return self._kv_events.drain() if self._kv_events is not None else []

    def kv_snapshot(self) -> list[KvEvent]:
        """The whole cache as events (cleared, then every cached block); it replaces the
        events not drained yet, which it already reflects."""
        with self._lock:
            self._check_open()
            if self._kv_events is not None:
                self._kv_events.drain()
            if isinstance(self.scheduler.kv.cache, RadixCache):
                return self.scheduler.kv.cache.snapshot_events()
            return [AllBlocksCleared()]

    def flush_cache(self) -> bool:
        """Empty the radix cache. Returns False (and does nothing) while requests run."""
        with self._lock:
            self._check_open()
            return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Abort everything, then free the model, the KV pool and (on CUDA) cached memory.

        The engine is unusable afterwards; `with Engine(...) as engine:` calls this on exit.
        """
        with self._lock:
            if self._closed:
                return
            for rid in list(self._groups):
                self.abort(rid)
                self.forget(rid)
            self._closed = True
            if isinstance(self.scheduler, ReplicatedScheduler):
                self.scheduler.others.stop()
            # The scheduler holds the pools and, through its callbacks, the engine: drop it
            # so nothing keeps the tensors alive until a cycle collection.
            del self.scheduler
            self.runner.close()
            destroy_tp_group(self.tp)
            thaw()  # what this engine froze at its start may be garbage now

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # -- internals --------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")

    def _step_if_busy(self) -> bool:
        """One step if there is work; False when idle."""
        with self._lock:
            if not self.has_work():
                return False
            self.step()
            return True

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _normalize_prompts(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        vocab = self.runner.vocab_size
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            # The tokenizer's own default: BOS where the model expects one (Llama 3), none
            # where it does not (SmolLM2), as transformers' generate would see it.
            ids = [checked_token_ids(self.tokenizer.encode(t), vocab) for t in texts]
            return ids, not isinstance(prompt, str)
        assert input_ids is not None
        if input_ids and isinstance(input_ids[0], list):
            return [checked_token_ids(ids, vocab) for ids in input_ids], True  # type: ignore[arg-type]
        return [checked_token_ids(input_ids, vocab)], False  # type: ignore[arg-type]

    def _normalize_params(
        self,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | SamplingParams | None,
        count: int,
    ) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != count:
                raise ValueError(f"{len(sampling_params)} sampling_params for {count} prompts")
            items = sampling_params
        else:
            items = [sampling_params] * count  # type: ignore[list-item]
        out = []
        for item in items:
            params = item if isinstance(item, SamplingParams) else SamplingParams.from_dict(item)
            params.validate(self.runner.vocab_size)
            out.append(params)
        return out

    def _checked_resume(
        self,
        resume_ids: Sequence[int] | np.ndarray | None,
        resume_choices: Mapping[int, Sequence[int] | np.ndarray] | None,
        params: SamplingParams,
    ) -> dict[int, list[int]] | None:
        """Each choice to run -> the output tokens it resumes after, by index (None: a
        plain request, every choice run from the start)."""
        if resume_choices is None:
            if resume_ids is None or len(resume_ids) == 0:
                return None
            if params.n != 1:
                raise ValueError(
                    f"resume_ids is for n == 1 requests only (resume_choices for more), "
                    f"got n = {params.n}"
                )
            return {0: self._checked_output_ids(resume_ids, "resume_ids")}
        if resume_ids is not None:
            raise ValueError("give resume_ids or resume_choices, not both")
        if not isinstance(resume_choices, Mapping):
            raise ValueError("resume_choices must map choice indices to output token ids")
        if not resume_choices:
            raise ValueError("resume_choices names no choice to run")
        resume = {}
        for index, ids in sorted(resume_choices.items()):
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < params.n:
                raise ValueError(
                    f"resume_choices has choice {index!r}; the request's choices are "
                    f"0..{params.n - 1} (n = {params.n})"
                )
            what = f"resume_choices[{index}]"
            resume[index] = self._checked_output_ids(ids, what) if len(ids) else []
        return resume

    def _checked_output_ids(self, ids: Sequence[int] | np.ndarray, what: str) -> list[int]:
        try:
            return checked_token_ids(ids, self.runner.vocab_size)
        except ValueError as exc:  # its wording names the prompt's parameter
            raise ValueError(f"{what} are not output token ids: {exc}") from None

    def _make_req(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        seed: int,
        priority: int,
        grammar: xgr.CompiledGrammar | None = None,
        resume: list[int] | None = None,
    ) -> Req:
        # ids come through checked_token_ids: non-empty, integers in the vocabulary.
        if len(ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        total = len(ids) + len(resume or ())
        if total > self.context_len:  # equal: the uninterrupted run ended there ("length")
            raise ValueError(
                f"the prompt and resume_ids have {total} tokens; "
                f"the context length is {self.context_len}"
            )
        if total >= self.runner.kv_pool.size:
            what = "the prompt and resume_ids have" if resume else "the prompt has"
            raise ValueError(f"{what} {total} tokens; the KV pool holds {self.runner.kv_pool.size}")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = Req(
            rid=rid,
            origin_input_ids=list(ids),
            params=params,
            seed=seed,
            stop_token_ids=frozenset(stop_ids),
            priority=priority,
        )
        if grammar is not None:  # each choice its own matcher over the shared grammar
            req.grammar = self.grammars.new_state(grammar, req.stop_token_ids, params)
        if resume:
            req.resume(resume)
        return req

    def _submit(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        grammar: xgr.CompiledGrammar | None = None,
        priority: int = 0,
        resume: dict[int, list[int]] | None = None,
    ) -> RequestGroup:
        """Queue one prompt; n > 1 runs the prompt's prefill once, then n samples share it.
        `resume` (checked by `_checked_resume`): the choices to run, each -> the output
        tokens it continues after; None: all n, from the start."""
        self._check_priority(priority)
        if grammar is None:
            grammar = self.grammars.compile_request(params)  # outside the lock: steps go on
        with self._lock:
            self._check_open()
            rid = rid or uuid.uuid4().hex
            if rid in self._groups:
                raise ValueError(f"request id {rid!r} is already in use")
            seed = resolve_seed(params)
            if params.n == 1:
                first = None if resume is None else resume[0]
                group = RequestGroup(
                    rid, [self._make_req(rid, ids, params, seed, priority, grammar, first)]
                )
            else:
                # Every choice is built (and so validated) before anything is queued.
                indices = list(range(params.n)) if resume is None else sorted(resume)
                choices = [
                    self._make_choice(rid, i, ids, params, seed, priority, grammar, resume)
                    for i in indices
                ]
                group = RequestGroup(rid, choices, indices=indices)
                if len(choices) > 1 and self.scheduler.kv.cache.reuses_prefixes:
                    prefill_params = SamplingParams.from_dict({"max_new_tokens": 0})
                    group.prefill = self._make_req(
                        f"{rid}-prefill", ids, prefill_params, seed, priority
                    )
            self._groups[rid] = group
            if group.prefill is not None:
                self._owner[group.prefill.rid] = (group, -1)
                self.scheduler.add_request(group.prefill)
            for index, choice in group.indexed():
                self._owner[choice.rid] = (group, index)
                reason = limit_reached(choice, self.context_len) if choice.resumed else None
                if reason is not None:  # resumed at its limit: nothing is left to generate
                    self._finish_unscheduled(choice, reason)
                    self._pending.append(ChoiceOutput(rid, index, choice))
                elif group.prefill is None:
                    self.scheduler.add_request(choice)
            return group

    def _make_choice(
        self,
        rid: str,
        index: int,
        ids: list[int],
        params: SamplingParams,
        seed: int,
        priority: int,
        grammar: xgr.CompiledGrammar | None,
        resume: dict[int, list[int]] | None,
    ) -> Req:
        """Choice `index` of an n > 1 request: its own rid and seed (seed + index), so a
        resumed choice continues exactly as it would have."""
        own = None if resume is None else resume[index]
        try:
            return self._make_req(
                f"{rid}-{index}", ids, params, seed + index, priority, grammar, own
            )
        except ValueError as exc:
            if resume is None:
                raise
            raise ValueError(f"resume_choices[{index}]: {exc}") from None  # which choice

    def _shared_prefill_done(self, group: RequestGroup, prefill: Req) -> list[ChoiceOutput]:
        """The hidden prefill of n > 1 ended: schedule the choices, or fail them with it."""
        self._owner.pop(prefill.rid, None)
        group.prefill = None
        reason = prefill.finish_reason
        if reason is not None and reason.kind == "abort":
            outputs = []
            for index, choice in group.indexed():
                if not choice.finished:
                    self._finish_unscheduled(choice, reason)
                    outputs.append(ChoiceOutput(group.rid, index, choice))
            return outputs
        for choice in group.choices:
            if not choice.finished:
                choice.arrival_time = prefill.arrival_time  # waiting since the prompt came
                self.scheduler.add_request(choice)
        return []

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")

    @staticmethod
    def _finish_unscheduled(req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
