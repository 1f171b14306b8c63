"""`Engine`: the in-process API (like `sglang.Engine`) over runner + scheduler.

Calls are synchronous; `generate_stream` runs engine steps in a worker thread so
an asyncio caller stays responsive. One lock serialises steps, so several streams
(and blocking calls from other threads) share one continuous batch.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.kvcache.base import PrefixCache
from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.model.tokenizer import apply_chat_template, load_tokenizer
from radixserve.engine.outputs import Tracked, final_output, stream_delta
from radixserve.engine.request import Req
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampling.params import SamplingParams, resolve_seed
from radixserve.engine.sched.scheduler import Scheduler


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        torch.manual_seed(self.config.random_seed)
        self.runner = ModelRunner(self.config)
        self.tokenizer = load_tokenizer(self.runner.model_path)
        self.context_len = self.runner.context_len
        cache: PrefixCache = (
            NaiveCache(self.runner.kv_pool)
            if self.config.disable_radix_cache
            else RadixCache(self.runner.kv_pool)
        )
        self.scheduler = Scheduler(
            self.config,
            self.runner,
            self.runner.kv_pool,
            self.runner.req_pool,
            cache,
            self.context_len,
            detokenize=lambda ids: self._decode(ids, False),
        )
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        self._lock = threading.RLock()
        self._tracked: dict[str, Tracked] = {}

    # -- public API -------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation; a list of prompts (or of input_ids lists) gives a list back."""
        prompts, batched = self._normalize_prompts(prompt, input_ids)
        params_list = self._normalize_params(sampling_params, len(prompts))
        groups = [self._submit(ids, p) for ids, p in zip(prompts, params_list, strict=True)]
        rids = [rid for group in groups for rid in group]
        try:
            while not all(self._tracked[rid].done for rid in rids):
                if not self._drive_once():
                    raise RuntimeError("the engine went idle with requests unfinished")
        finally:
            for rid in rids:
                if not self._tracked[rid].done:
                    self.abort(rid)
        outputs = [final_output(self._tracked.pop(rid), self._decode) for rid in rids]
        if batched or len(outputs) > 1:
            return outputs
        return outputs[0]

    async def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields deltas {text, output_ids, finished, meta_info} until the request finishes."""
        prompts, batched = self._normalize_prompts(prompt, input_ids)
        if batched:
            raise ValueError("generate_stream takes one prompt")
        params = self._normalize_params(sampling_params, 1)[0]
        if params.n != 1:
            raise ValueError("generate_stream supports n == 1 only")
        (rid,) = self._submit(prompts[0], params)
        tracked = self._tracked[rid]
        try:
            while True:
                delta = stream_delta(tracked, self._decode)
                if delta is not None:
                    yield delta
                    if delta["finished"]:
                        return
                elif not await asyncio.to_thread(self._drive_once) and not tracked.req.finished:
                    raise RuntimeError("the engine went idle with the request unfinished")
        finally:
            if not tracked.done:
                self.abort(rid)
            self._tracked.pop(rid, None)

    def chat(
        self, messages: list[dict[str, str]], sampling_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        ids = apply_chat_template(self.tokenizer, messages)
        out = self.generate(input_ids=ids, sampling_params=sampling_params)
        assert isinstance(out, dict)
        return out

    def abort(self, rid: str) -> bool:
        with self._lock:
            tracked = self._tracked.get(rid)
            if tracked is not None:
                for child in tracked.children:
                    self.scheduler.abort(child.rid)
                    self._tracked[child.rid].done = True
            found = self.scheduler.abort(rid)
            if tracked is not None:
                tracked.done = True
            return found

    def flush_cache(self) -> bool:
        """Empty the radix cache. Returns False (and does nothing) while requests run."""
        with self._lock:
            return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        with self._lock:
            for rid in list(self._tracked):
                self.abort(rid)

    # -- internals --------------------------------------------------------------
    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _normalize_prompts(
        self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            # The tokenizer's own default: BOS where the model expects one (Llama 3), none
            # where it does not (SmolLM2), as transformers' generate would see it.
            return [self.tokenizer.encode(t) for t in texts], not isinstance(prompt, str)
        assert input_ids is not None
        if input_ids and isinstance(input_ids[0], list):
            return [list(map(int, ids)) for ids in input_ids], True  # type: ignore[arg-type]
        return [list(map(int, input_ids))], False  # type: ignore[arg-type]

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
            if (
                params.regex is not None
                or params.json_schema is not None
                or params.ebnf is not None
            ):
                raise ValueError(
                    "constrained decoding (regex/json_schema/ebnf) is not available yet"
                )
            out.append(params)
        return out

    def _make_req(self, ids: list[int], params: SamplingParams, seed: int | None = None) -> Req:
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.runner.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.runner.vocab_size})")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        if len(ids) >= self.runner.kv_pool.size:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the KV pool holds {self.runner.kv_pool.size}"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return Req(
            rid=uuid.uuid4().hex,
            origin_input_ids=list(ids),
            params=params,
            seed=resolve_seed(params) if seed is None else seed,
            stop_token_ids=frozenset(stop_ids),
        )

    def _submit(self, ids: list[int], params: SamplingParams) -> list[str]:
        """Queue one prompt; n > 1 runs the prompt's prefill once, then n samples share it."""
        with self._lock:
            if params.n == 1:
                req = self._make_req(ids, params)
                self._tracked[req.rid] = Tracked(req)
                self.scheduler.add_request(req)
                return [req.rid]
            base_seed = resolve_seed(params)
            children = [self._make_req(ids, params, seed=base_seed + i) for i in range(params.n)]
            for child in children:
                self._tracked[child.rid] = Tracked(child)
            if not self.scheduler.kv.cache.reuses_prefixes:
                for child in children:
                    self.scheduler.add_request(child)
                return [c.rid for c in children]
            parent_params = SamplingParams.from_dict({"max_new_tokens": 0})
            parent = self._make_req(ids, parent_params)
            self._tracked[parent.rid] = Tracked(parent, children=children, hidden=True)
            self.scheduler.add_request(parent)
            return [c.rid for c in children]

    def _drive_once(self) -> bool:
        """One scheduler step; False when there was nothing to do."""
        with self._lock:
            if not self.scheduler.has_work():
                return False
            for out in self.scheduler.step():
                tracked = self._tracked.get(out.req.rid)
                if tracked is None or not out.finished:
                    continue
                tracked.done = True
                if tracked.hidden:
                    self._tracked.pop(out.req.rid)
                    for child in tracked.children:
                        if not self._tracked[child.rid].done:
                            self.scheduler.add_request(child)
            return True
