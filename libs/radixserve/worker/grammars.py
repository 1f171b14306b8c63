"""The worker's side of structured outputs: the compiled grammar of a routed request.

    loader = GrammarLoader(engine.grammars, fetch=ask_grammar_service)
    grammar = await loader.load(routed.request)     # GrammarLoadError -> RequestError
    driver.submit(routed, grammar)

Runs on the worker's event loop, one task per constrained request, so a request
waiting for its grammar holds nobody back (the engine never waits). In order:

1. the engine's own LRU (another request of the same grammar loaded it);
2. the grammar service's artifact by key (`{p}.grammar.fetch`), deserialized off the
   loop: no compile on the worker;
3. else (no reply, no artifact, an artifact for another xgrammar or vocabulary) the
   source, from the reply or from the request's own sampling fields, compiled off
   the loop with a timeout.

One load per key at a time: 64 requests of one schema fetch it once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from radixserve import protocol
from radixserve.grammar.source import GrammarSource, InvalidGrammar, grammar_source_of
from radixserve.protocol.grammar import (
    GRAMMAR_INVALID,
    GRAMMAR_UNAVAILABLE,
    GrammarFetchReply,
    GrammarFetchRequest,
)

if TYPE_CHECKING:
    from radixserve.engine.constrained import GrammarBackend

log = logging.getLogger(__name__)

# None: no answer (timeout, no grammar service); the caller bounds the wait.
FetchGrammar = Callable[[GrammarFetchRequest], Awaitable[GrammarFetchReply | None]]
RETRY_AFTER_S = 1.0


class GrammarLoadError(Exception):
    """The request cannot run: its grammar is invalid (400) or cannot be had now (503)."""

    def __init__(self, code: str, message: str, http_status: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status

    def to_request_error(self, request: protocol.TokenizedRequest) -> protocol.RequestError:
        source = grammar_source_of(lambda name: getattr(request.sampling, name, None))
        retry = self.http_status == 503
        return protocol.RequestError(
            rid=request.rid,
            code=self.code,
            message=self.message,
            http_status=self.http_status,
            error_type="server_error" if retry else "invalid_request_error",
            param=source.param if source is not None else None,
            service="worker",
            retry_after_s=RETRY_AFTER_S if retry else None,
        )


class GrammarLoader:
    def __init__(
        self, backend: GrammarBackend, fetch: FetchGrammar, compile_timeout_s: float = 30.0
    ) -> None:
        self.backend = backend
        self.fetch = fetch
        self.compile_timeout_s = compile_timeout_s
        # One load per key at a time; concurrent requests for the key share its outcome
        # (a compile past its timeout included: its thread goes on and caches the result,
        # so the next request after it finds the grammar instead of compiling again).
        self._loads: dict[str, asyncio.Task[Any]] = {}
        # How grammars were had (tests and logs read them).
        self.loaded_artifacts = 0
        self.compiled_sources = 0

    async def load(self, request: protocol.TokenizedRequest) -> Any:
        """The request's compiled grammar (an `xgrammar.CompiledGrammar`)."""
        key = request.grammar_key
        if key is None:
            raise ValueError("the request has no grammar_key")
        compiled = self.backend.cached(key)
        if compiled is not None:
            return compiled
        task = self._loads.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._load(key, request), name=f"grammar-load-{key}"
            )
            self._loads[key] = task
            task.add_done_callback(functools.partial(self._load_done, key))
        # A waiter cancelled (its request aborted) leaves the load to the others.
        return await asyncio.shield(task)

    def _load_done(self, key: str, task: asyncio.Task[Any]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters (if any are left) get it raised

    async def _load(self, key: str, request: protocol.TokenizedRequest) -> Any:
        reply = await self.fetch(GrammarFetchRequest(rid=request.rid, key=key))
        if reply is not None and not reply.ok and reply.code == GRAMMAR_INVALID:
            raise GrammarLoadError(GRAMMAR_INVALID, reply.error or "invalid grammar", 400)
        if reply is not None and reply.ok and reply.compiled is not None:
            from radixserve.grammar.artifact import ArtifactMismatch

            try:
                compiled = await asyncio.to_thread(
                    self.backend.load, key, reply.compiled, reply.compiled_format
                )
            except ArtifactMismatch as exc:
                log.info("compiling grammar %s here: %s", key, exc, extra={"rid": request.rid})
            else:
                self.loaded_artifacts += 1
                return compiled
        return await self._compile(key, _source(reply, request), request.rid)

    async def _compile(self, key: str, source: GrammarSource | None, rid: str) -> Any:
        if source is None:
            raise GrammarLoadError(
                GRAMMAR_UNAVAILABLE, "the grammar is unknown to the grammar service", 503
            )
        try:
            # The thread goes on past the timeout and caches its result for a retry.
            compiled = await asyncio.wait_for(
                asyncio.to_thread(self.backend.compile_keyed, key, source), self.compile_timeout_s
            )
        except InvalidGrammar as exc:
            raise GrammarLoadError(GRAMMAR_INVALID, exc.message, 400) from exc
        except TimeoutError as exc:
            raise GrammarLoadError(
                GRAMMAR_UNAVAILABLE,
                f"compiling the grammar took longer than {self.compile_timeout_s:g}s",
                503,
            ) from exc
        self.compiled_sources += 1
        log.debug("compiled grammar %s from its source", key, extra={"rid": rid})
        return compiled


def _source(
    reply: GrammarFetchReply | None, request: protocol.TokenizedRequest
) -> GrammarSource | None:
    if reply is not None and reply.ok and reply.kind is not None and reply.source is not None:
        return GrammarSource(reply.kind, reply.source)
    # The request carries its own source (the sampling field the key was made from).
    return grammar_source_of(lambda name: getattr(request.sampling, name, None))
