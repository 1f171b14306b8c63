"""grammar service: compiles regex / json_schema / ebnf / structural_tag grammars with
xgrammar for the served tokenizer and serves them by key (docs/request-path.md).

`{p}.grammar.compile` (from the tokenizer) answers the grammar's key, or the
compiler's reason (400 `invalid_grammar`), or "retry later" (503: a compile past
`--compile-timeout-s`, a tokenizer this replica does not serve). `{p}.grammar.fetch`
(from a worker) answers the serialized compiled grammar with its source. The logic
(memory LRU, Redis, one compile per key, the timeout) is `radixserve.grammar.registry`;
compiles run in `--compile-workers` child processes, each compile stopped past
`--compile-limit-s` (`radixserve.grammar.processes`); this file only moves messages.
Both subjects are in the queue group `grammar`: scale by replicas, which share compiled
grammars through Redis (`--cache-ttl-s`; `--no-redis-cache`: memory only).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from radixserve.bus import BusMsg
from radixserve.bus.client import Handler
from radixserve.protocol import (
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    QueueGroups,
    encode,
)
from radixserve.services.messages import decode_or_drop
from radixserve.services.runtime import (
    ENV_MODEL,
    ServiceContext,
    ServiceSettings,
    model_path_from,
    settings_from_args,
)
from radixserve.telemetry import genai
from radixserve.telemetry.pipeline_metrics import GrammarMetrics
from radixserve.telemetry.tracing import get_tracer

log = logging.getLogger(__name__)

SERVICE = "grammar"
_tracer = get_tracer(SERVICE)


@dataclass(frozen=True)
class GrammarSettings:
    service: ServiceSettings
    model: str | None = None  # None: the embedded SmolLM2
    compile_timeout_s: float = 4.0
    compile_limit_s: float = 30.0  # 0: compile in threads, without a limit
    compile_workers: int = 2
    cache_ttl_s: float = 7 * 24 * 3600.0
    redis_cache: bool = True  # False: compiled grammars in memory only


class GrammarBackend(Protocol):
    """What the service asks for each request (`GrammarRegistry`); tested without NATS."""

    async def compile(self, req: GrammarCompileRequest) -> GrammarCompileReply: ...

    async def fetch(self, req: GrammarFetchRequest) -> GrammarFetchReply: ...

    async def close(self) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=f"HF folder or .gguf whose tokenizer grammars are compiled for; the same as "
        f"the tokenizer's and workers' (default ${ENV_MODEL}, else the embedded SmolLM2)",
    )
    parser.add_argument(
        "--compile-timeout-s",
        type=float,
        default=4.0,
        help="answer 'retry later' past this (the compile goes on and is cached); keep it "
        "below the tokenizer's --grammar-timeout-s",
    )
    parser.add_argument(
        "--compile-limit-s",
        type=float,
        default=30.0,
        help="stop a compile past this and refuse its grammar (400 invalid_grammar); 0: "
        "compile in threads, without a limit",
    )
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=2,
        help="compiles at once, each in its own process (each holds the tokenizer's xgrammar info)",
    )
    parser.add_argument(
        "--cache-ttl-s", type=float, default=7 * 24 * 3600.0, help="compiled grammars in Redis"
    )
    parser.add_argument("--no-redis-cache", action="store_true", help="memory cache only")


def settings_from(ns: argparse.Namespace) -> GrammarSettings:
    return GrammarSettings(
        service=settings_from_args(SERVICE, ns),
        model=model_path_from(ns.model),
        compile_timeout_s=ns.compile_timeout_s,
        compile_limit_s=ns.compile_limit_s,
        compile_workers=ns.compile_workers,
        cache_ttl_s=ns.cache_ttl_s,
        redis_cache=not ns.no_redis_cache,
    )


async def start(ctx: ServiceContext, settings: GrammarSettings) -> None:
    metrics = GrammarMetrics(ctx.metrics)
    await _subscribe(ctx, await _registry(ctx, settings, metrics), metrics)


async def _registry(
    ctx: ServiceContext, settings: GrammarSettings, metrics: GrammarMetrics
) -> GrammarBackend:
    # Heavy imports (transformers, xgrammar) only once the service really starts.
    from radixserve.grammar.setup import registry_for_model
    from radixserve.store.grammar_cache import RedisGrammarCache

    remote = None
    if settings.redis_cache:
        remote = RedisGrammarCache(settings.service.store_settings(), ttl_s=settings.cache_ttl_s)
    registry = await asyncio.to_thread(
        registry_for_model,
        settings.model,
        remote=remote,
        compile_timeout_s=settings.compile_timeout_s,
        compile_limit_s=settings.compile_limit_s,
        compile_workers=settings.compile_workers,
        spawn=ctx.spawn,
        on_stop=metrics.observe_stop,
    )
    log.info(
        "compiling grammars for tokenizer %s (vocabulary %d), Redis cache %s",
        registry.tokenizer_id,
        registry.vocab_size,
        "off" if remote is None else "on",
    )
    return registry


async def _subscribe(
    ctx: ServiceContext, grammars: GrammarBackend, metrics: GrammarMetrics
) -> None:

    async def on_compile(msg: BusMsg) -> None:
        req = decode_or_drop(msg, GrammarCompileRequest, log)
        if req is None:  # no rid to answer: the requester's timeout reports it unavailable
            return
        # Parent: the tokenizer's span (the handler runs in the sender's context).
        with _tracer.start_as_current_span(
            genai.SPAN_GRAMMAR_COMPILE,
            attributes={genai.REQUEST_ID: req.rid, "radixserve.grammar.kind": req.kind},
        ) as span:
            started = time.perf_counter()
            reply = await grammars.compile(req)
            metrics.observe_compile(req.kind, reply.ok, time.perf_counter() - started, reply.cached)
            span.set_attribute("radixserve.grammar.cached", reply.cached)
            if not reply.ok:
                span.set_attribute(genai.ERROR_CODE, reply.code or "grammar_not_supported")
        log.debug(
            "compile %s: ok=%s cached=%s", req.kind, reply.ok, reply.cached, extra={"rid": req.rid}
        )
        if msg.reply:
            await ctx.bus.respond(msg, encode(reply))

    async def on_fetch(msg: BusMsg) -> None:
        req = decode_or_drop(msg, GrammarFetchRequest, log)
        if req is None:
            return
        with _tracer.start_as_current_span(
            genai.SPAN_GRAMMAR_FETCH, attributes={genai.REQUEST_ID: req.rid}
        ):
            reply = await grammars.fetch(req)
        metrics.observe_fetch(reply.ok)
        if msg.reply:
            await ctx.bus.respond(msg, encode(reply))

    # One task per message: a request waiting on a compile holds no other back.
    subscriptions = [
        await ctx.bus.subscribe(
            ctx.subjects.grammar_compile, _each_in_task(ctx, on_compile), queue=QueueGroups.GRAMMAR
        ),
        await ctx.bus.subscribe(
            ctx.subjects.grammar_fetch, _each_in_task(ctx, on_fetch), queue=QueueGroups.GRAMMAR
        ),
    ]

    async def drain() -> None:
        for subscription in subscriptions:
            await subscription.drain()
        await grammars.close()

    ctx.on_drain(drain)


MAX_CONCURRENT_MESSAGES = 256


def _each_in_task(ctx: ServiceContext, handler: Callable[[BusMsg], Awaitable[None]]) -> Handler:
    """Handle each message in its own supervised task (bounded; past the bound the
    subscription waits and NATS buffers): NATS calls a subscription's handler one
    message at a time, and a compile must not hold up a fetch or a cached answer."""
    slots = asyncio.Semaphore(MAX_CONCURRENT_MESSAGES)

    async def guarded(msg: BusMsg) -> None:
        try:
            await handler(msg)
        except Exception:  # one bad message must not stop the replica
            log.exception("handling %s failed", msg.subject)
        finally:
            slots.release()

    async def dispatch(msg: BusMsg) -> None:
        await slots.acquire()
        ctx.spawn(guarded(msg), "grammar-message")

    return dispatch
