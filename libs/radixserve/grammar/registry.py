"""The grammar service's library: compile once, answer from memory, Redis or the compiler.

    registry = GrammarRegistry(build=entry_builder(compiler, tokenizer_id),
                               tokenizer_id=tokenizer_id, remote=redis_cache)
    reply = await registry.compile(compile_request)     # GrammarCompileReply
    reply = await registry.fetch(fetch_request)         # GrammarFetchReply

A compile looks in the in-memory LRU, then joins a compile of the same key already
running, then asks Redis (another replica, or this one before a restart, compiled
it), and only then compiles, in a worker thread with a timeout. A compile that
outlives the timeout keeps running and caches its result, so the client's retry
(the reply is a 503 `grammar_unavailable`) finds it. Refusals (invalid grammars)
are cached in memory only: they are cheap to reproduce and not worth sharing. The
service's `build` runs each compile in a child process stopped past a hard limit
(`processes.CompileProcesses`); that stop is a refusal too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from radixserve.grammar.entry import GrammarEntry
from radixserve.grammar.lru import BoundedLru
from radixserve.grammar.source import GrammarSource, InvalidGrammar
from radixserve.protocol.grammar import (
    GRAMMAR_INVALID,
    GRAMMAR_UNAVAILABLE,
    GRAMMAR_UNKNOWN_KEY,
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    grammar_key,
)

if TYPE_CHECKING:
    from radixserve.grammar.compile import XGrammarCompiler

log = logging.getLogger(__name__)

BuildEntry = Callable[[GrammarSource], GrammarEntry]
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[Any]"]
# NATS' default max_payload is 1 MiB; the fetch reply also carries the source.
DEFAULT_MAX_REPLY_BYTES = 1_000_000


class RemoteGrammarCache(Protocol):
    """Where entries are shared between replicas (Redis: `store.grammar_cache`). Both
    calls must bound their own time and never raise: the cache is an optimisation."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes) -> None: ...


@dataclass
class RegistryCounters:
    """How compiles were answered (tests and metrics read them)."""

    compiled: int = 0  # ran the compiler
    memory_hits: int = 0
    remote_hits: int = 0  # found in Redis
    joined: int = 0  # waited on a compile of the same key already running
    invalid: int = 0  # the compiler refused the source
    timeouts: int = 0


@dataclass(frozen=True)
class RegistrySettings:
    compile_timeout_s: float = 4.0  # below the tokenizer's 5 s wait for the reply
    # A grammar whose compile was stopped past the limit is refused this long, then
    # compiled again (a busy or throttled host may have been to blame).
    stopped_ttl_s: float = 600.0
    memory_entries: int = 1024
    memory_bytes: int = 256 * 1024 * 1024
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES

    def __post_init__(self) -> None:
        if self.compile_timeout_s <= 0:
            raise ValueError(f"compile timeout must be > 0, got {self.compile_timeout_s}")


def entry_builder(compiler: XGrammarCompiler, tokenizer_id: str) -> BuildEntry:
    """Compile + serialize (CPU-bound: runs in the registry's executor)."""
    from radixserve.grammar.artifact import artifact_format, serialize

    fmt = artifact_format()

    def build(source: GrammarSource) -> GrammarEntry:
        base = GrammarEntry(kind=source.kind, source=source.source, tokenizer_id=tokenizer_id)
        try:
            compiled = compiler.compile(source)
        except InvalidGrammar as exc:
            return msgspec.structs.replace(base, error=exc.message)
        return msgspec.structs.replace(base, artifact=serialize(compiled), artifact_format=fmt)

    return build


class GrammarRegistry:
    def __init__(
        self,
        *,
        build: BuildEntry,
        tokenizer_id: str,
        remote: RemoteGrammarCache | None = None,
        settings: RegistrySettings | None = None,
        executor: Executor | None = None,
        spawn: Spawn | None = None,
        vocab_size: int = 0,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.build = build
        self._release = release  # blocking: stops what `build` holds (its processes)
        self.vocab_size = vocab_size  # informational: what the artifacts are built for
        self.tokenizer_id = tokenizer_id
        self.remote = remote
        self.settings = settings or RegistrySettings()
        self.counters = RegistryCounters()
        self._memory: BoundedLru[GrammarEntry] = BoundedLru(
            self.settings.memory_entries, self.settings.memory_bytes, lambda e: e.size_bytes
        )
        self._executor = executor or ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, asyncio.Future[GrammarEntry]] = {}
        # The service's supervised spawn (ServiceContext.spawn); a plain task otherwise.
        self.spawn = spawn
        self._tasks: set[asyncio.Future[Any]] = set()

    # -- compile ---------------------------------------------------------------------
    async def compile(self, req: GrammarCompileRequest) -> GrammarCompileReply:
        if req.tokenizer_id != self.tokenizer_id:
            return _refused(
                req.rid,
                GRAMMAR_UNAVAILABLE,
                f"this grammar service compiles for tokenizer {self.tokenizer_id}, "
                f"not {req.tokenizer_id} (start it with the same --model as the tokenizer)",
            )
        try:
            source = GrammarSource(req.kind, req.source)
        except ValueError as exc:
            return _refused(req.rid, GRAMMAR_INVALID, str(exc))
        key = grammar_key(source.kind, source.source, self.tokenizer_id)
        try:
            entry, cached = await self._entry(key, source)
        except Exception as exc:  # the compiler crashed (not a refusal): answer, don't hang
            return _refused(req.rid, GRAMMAR_UNAVAILABLE, f"compiling failed: {exc!r}", key=key)
        if entry is None:
            self.counters.timeouts += 1
            timeout = self.settings.compile_timeout_s
            return _refused(
                req.rid,
                GRAMMAR_UNAVAILABLE,
                f"compiling the grammar took longer than {timeout:g}s; it goes on, retry later",
                key=key,
            )
        if not entry.ok:
            self.counters.invalid += 1 if not cached else 0
            return _refused(req.rid, GRAMMAR_INVALID, entry.error or "invalid grammar", key=key)
        return GrammarCompileReply(rid=req.rid, key=key, ok=True, cached=cached)

    async def _entry(self, key: str, source: GrammarSource) -> tuple[GrammarEntry | None, bool]:
        """(entry, was it cached); (None, False) when compiling outlived the timeout."""
        entry = self._memory.get(key)
        if entry is not None and entry.stopped_at is not None:
            if time.time() - entry.stopped_at > self.settings.stopped_ttl_s:
                self._memory.pop(key)
                entry = None
        if entry is not None:
            self.counters.memory_hits += 1
            return entry, True
        running = self._compiling.get(key)
        if running is not None:
            self.counters.joined += 1
            return await self._wait(running), True
        future: asyncio.Future[GrammarEntry] = asyncio.get_running_loop().create_future()
        self._compiling[key] = future
        try:
            entry = await self._from_remote(key)
            if entry is not None:
                self.counters.remote_hits += 1
                self._remember(key, entry)
                self._compiling.pop(key, None)
                future.set_result(entry)
                return entry, True
        except BaseException as exc:
            self._compiling.pop(key, None)
            future.set_exception(exc)
            future.exception()  # retrieved: joiners get it; no "never retrieved" warning
            raise
        self._start_compile(key, source, future)
        return await self._wait(future), False

    def _start_compile(
        self, key: str, source: GrammarSource, future: asyncio.Future[GrammarEntry]
    ) -> None:
        self.counters.compiled += 1
        self._spawn(self._compile_and_share(key, source, future), f"compile-{key}")

    async def _compile_and_share(
        self, key: str, source: GrammarSource, future: asyncio.Future[GrammarEntry]
    ) -> None:
        """Runs to the end even when every requester stopped waiting (their timeout)."""
        loop = asyncio.get_running_loop()
        try:
            entry = await loop.run_in_executor(self._executor, self.build, source)
        except Exception as exc:  # a compiler crash: fail this key's waiters, not the service
            log.error("compiling grammar %s failed: %r", key, exc)
            self._compiling.pop(key, None)
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            return
        self._remember(key, entry)
        self._compiling.pop(key, None)
        future.set_result(entry)
        if entry.ok and self.remote is not None:
            # After the waiters have their answer; the store bounds its own time.
            await self.remote.put(key, entry.to_bytes())

    async def _wait(self, future: asyncio.Future[GrammarEntry]) -> GrammarEntry | None:
        try:
            # shield: the compile (and the other requests waiting on it) outlive our timeout.
            return await asyncio.wait_for(
                asyncio.shield(future), timeout=self.settings.compile_timeout_s
            )
        except TimeoutError:
            return None

    # -- fetch -------------------------------------------------------------------------
    async def fetch(self, req: GrammarFetchRequest) -> GrammarFetchReply:
        entry = self._memory.get(req.key)
        if entry is None:
            running = self._compiling.get(req.key)
            if running is not None:
                with contextlib.suppress(Exception):  # a crashed compile: answered unknown
                    entry = await self._wait(running)
        if entry is None:
            entry = await self._from_remote(req.key)
            if entry is not None:
                self._remember(req.key, entry)
        if entry is None:
            return GrammarFetchReply(
                rid=req.rid,
                key=req.key,
                ok=False,
                code=GRAMMAR_UNKNOWN_KEY,
                error="unknown grammar key (not compiled here, not in Redis)",
            )
        if not entry.ok:
            return GrammarFetchReply(
                rid=req.rid, key=req.key, ok=False, code=GRAMMAR_INVALID, error=entry.error
            )
        artifact = entry.artifact
        room = self.settings.max_reply_bytes - len(entry.source.encode()) - 4096
        if artifact is not None and len(artifact) > room:
            artifact = None  # too large for one message: the worker compiles the source
        return GrammarFetchReply(
            rid=req.rid,
            key=req.key,
            ok=True,
            kind=entry.kind,
            source=entry.source,
            tokenizer_id=entry.tokenizer_id,
            compiled=artifact,
            compiled_format=entry.artifact_format if artifact is not None else None,
        )

    # -- caches ------------------------------------------------------------------------
    def _remember(self, key: str, entry: GrammarEntry) -> None:
        self._memory.put(key, entry)

    async def _from_remote(self, key: str) -> GrammarEntry | None:
        if self.remote is None:
            return None
        data = await self.remote.get(key)
        if data is None:
            return None
        try:
            return GrammarEntry.from_bytes(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("unreadable grammar cache entry %s: %s", key, exc)
            return None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self.spawn is not None:
            self._tasks.add(self.spawn(coro, name))
        else:
            self._tasks.add(asyncio.ensure_future(coro))
        self._tasks = {t for t in self._tasks if not t.done()}

    async def close(self, timeout_s: float = 2.0) -> None:
        """Wait (bounded) for the compiles and Redis writes in flight; stop the threads
        (and the compile processes)."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        if self._release is not None:
            await asyncio.to_thread(self._release)
        self._executor.shutdown(wait=False, cancel_futures=True)


def _refused(rid: str, code: str, message: str, key: str = "") -> GrammarCompileReply:
    return GrammarCompileReply(rid=rid, key=key, ok=False, error=message, code=code)
