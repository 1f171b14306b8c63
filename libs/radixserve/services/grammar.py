"""grammar service: compiles regex / json_schema / ebnf grammars and serves them by key.

Until structured outputs arrive it refuses every compile (the tokenizer turns that
into a 400 `grammar_not_supported`) and knows no key. It starts, answers and
heartbeats like every service, so the request path is whole. The answers come from a
`GrammarBackend`; the xgrammar one replaces `UnsupportedGrammars` without touching
the loop below.
"""

from __future__ import annotations

import argparse
import logging
from typing import Protocol

from radixserve.bus import BusMsg
from radixserve.protocol import (
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    ProtocolError,
    QueueGroups,
    decode,
    encode,
)
from radixserve.services.runtime import ServiceContext, run_service, settings_from_args

log = logging.getLogger(__name__)

SERVICE = "grammar"
NOT_SUPPORTED = "structured outputs (regex/json_schema/ebnf) are not supported yet"
UNKNOWN_KEY = "unknown grammar key"


class GrammarBackend(Protocol):
    """What the service asks for each request; pure, so it is tested without NATS."""

    def compile(self, req: GrammarCompileRequest) -> GrammarCompileReply: ...

    def fetch(self, req: GrammarFetchRequest) -> GrammarFetchReply: ...


class UnsupportedGrammars:
    """No grammar engine yet: refuse every compile, know no key."""

    def compile(self, req: GrammarCompileRequest) -> GrammarCompileReply:
        return GrammarCompileReply(rid=req.rid, key="", ok=False, error=NOT_SUPPORTED)

    def fetch(self, req: GrammarFetchRequest) -> GrammarFetchReply:
        return GrammarFetchReply(rid=req.rid, key=req.key, ok=False, error=UNKNOWN_KEY)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no flags of its own yet


def run(ns: argparse.Namespace) -> int:
    return run_service(settings_from_args(SERVICE, ns), start)


async def start(ctx: ServiceContext, backend: GrammarBackend | None = None) -> None:
    grammars: GrammarBackend = backend or UnsupportedGrammars()

    async def on_compile(msg: BusMsg) -> None:
        try:
            req = decode(msg.data, GrammarCompileRequest)
        except ProtocolError as exc:
            # No rid to answer with: the requester's timeout reports it as unavailable.
            log.warning("malformed GrammarCompileRequest: %s", exc)
            return
        reply = grammars.compile(req)
        log.debug("compile %s: ok=%s", req.kind, reply.ok, extra={"rid": req.rid})
        if msg.reply:
            await ctx.bus.respond(msg, encode(reply))

    async def on_fetch(msg: BusMsg) -> None:
        try:
            req = decode(msg.data, GrammarFetchRequest)
        except ProtocolError as exc:
            log.warning("malformed GrammarFetchRequest: %s", exc)
            return
        reply = grammars.fetch(req)
        if msg.reply:
            await ctx.bus.respond(msg, encode(reply))

    subscriptions = [
        await ctx.bus.subscribe(
            ctx.subjects.grammar_compile, on_compile, queue=QueueGroups.GRAMMAR
        ),
        await ctx.bus.subscribe(ctx.subjects.grammar_fetch, on_fetch, queue=QueueGroups.GRAMMAR),
    ]

    async def drain() -> None:
        for subscription in subscriptions:
            await subscription.drain()

    ctx.on_drain(drain)
