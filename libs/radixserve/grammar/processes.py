"""Grammar compiles in child processes, stopped past a time limit.

xgrammar compiles in C++ and cannot be interrupted, and some grammars take minutes: a
JSON schema whose string `pattern` is `^.{0,9000}$` took 34 s on the dev box, and the
time grows faster than the bound. In a thread such a compile holds its thread (and a
core) to the end; a few of them wedge every constrained request of the replica.

`CompileProcesses` is the registry's `BuildEntry`: each compile runs in one of N
long-lived child processes, each holding the tokenizer's xgrammar info. A compile past
`limit_s` is stopped by killing its process (a new one starts in the background) and
the grammar is refused: the registry caches that refusal like a compiler error, so
the client's retries get a 400 saying so instead of starting the compile again.

    build = CompileProcesses(CompilerSpec(folder, tokenizer_id, vocab_size), 2, 30.0)
    entry = build(GrammarSource("regex", "[0-9]+"))   # blocking: call it from a thread
    build.close()

Each child is `python -m radixserve.grammar.processes` (a fresh interpreter: a fork of
a threaded, asyncio parent is unsafe); it imports xgrammar and loads the tokenizer, a
few seconds, before it says it is ready. Requests and replies are msgpack over two
pipes. A child whose parent died ends within a second, in a compile or not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from radixserve.grammar.entry import GrammarEntry
from radixserve.grammar.source import GrammarSource

log = logging.getLogger(__name__)

_READY = b"ready"
# Reply tags: an entry (the compiler's artifact or refusal), or the compiler's crash.
_ENTRY = b"E"
_CRASH = b"C"
# Waiting for a free child: at most the registry's threads wait, one per child, so
# this is only reached if a child's restart keeps failing.
ACQUIRE_TIMEOUT_S = 300.0


class CompilerUnavailable(RuntimeError):
    """A compile process could not start, or died in the middle of a compile."""


@dataclass(frozen=True)
class CompilerSpec:
    """What a child builds its compiler from (passed on its command line)."""

    folder: str  # the model folder whose tokenizer grammars are compiled for
    tokenizer_id: str
    vocab_size: int  # the model's logits width


def too_long_message(limit_s: float) -> str:
    return (
        f"compiling this grammar took longer than {limit_s:g}s and was stopped; make it "
        "simpler (smaller repetition bounds in patterns, fewer alternatives)"
    )


def _exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """In a daemon thread: end this process once its parent is gone (killed, say). An
    idle child sees its pipe close; this ends one in the middle of a compile (xgrammar
    releases the GIL while it compiles)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_main(requests: Connection, replies: Connection, spec: CompilerSpec) -> None:
    """A child: build the compiler, say ready, compile each request until the pipe ends."""
    _exit_with_parent(os.getppid())
    # Ctrl-C in a terminal signals the whole process group: the parent stops its children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from radixserve.grammar.compile import XGrammarCompiler
    from radixserve.grammar.registry import entry_builder
    from radixserve.model_files.tokenizer import load_tokenizer

    compiler = XGrammarCompiler.for_tokenizer(load_tokenizer(spec.folder), spec.vocab_size)
    build = entry_builder(compiler, spec.tokenizer_id)
    replies.send_bytes(_READY)
    while True:
        try:
            kind, source = msgspec.msgpack.decode(requests.recv_bytes())
        except EOFError:  # the parent closed the pipe (or died)
            return
        try:
            reply = _ENTRY + build(GrammarSource(kind, source)).to_bytes()
        except Exception as exc:  # a compiler crash, not a refusal: the parent reports it
            reply = _CRASH + repr(exc).encode()
        replies.send_bytes(reply)


class _Child:
    """One compile process (`python -m radixserve.grammar.processes`) and its two pipes.

    A plain subprocess, not multiprocessing's spawn: that re-imports the parent's main
    module, which need not be import-safe. `close` may come from another thread while
    `start` waits for the process to be ready: the lock orders them, so a process started
    after `close` is killed at once, and one started before it is killed by it.
    """

    def __init__(self, spec: CompilerSpec, index: int, start_timeout_s: float) -> None:
        self._spec = spec
        self.index = index
        self._start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None  # parent -> child
        self._replies: Connection | None = None  # child -> parent

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    @property
    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        self.kill()
        proc, requests, replies = self._spawn()
        with self._lock:
            closed = self._closed
            if not closed:
                self._proc, self._requests, self._replies = proc, requests, replies
        if closed:
            _end(proc, requests, replies)
            raise CompilerUnavailable(f"grammar compile process {self.index} is closed")
        try:
            ready = replies.poll(self._start_timeout_s) and replies.recv_bytes() == _READY
        except (EOFError, OSError):  # it exited, or kill() closed the pipe meanwhile
            ready = False
        if not ready:
            code = proc.poll()
            self.kill()
            raise CompilerUnavailable(
                f"grammar compile process {self.index} did not start within "
                f"{self._start_timeout_s:g}s (exit code {code})"
            )

    def _spawn(self) -> tuple[subprocess.Popen[bytes], Connection, Connection]:
        spec = self._spec
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    str(request_r),
                    str(reply_w),
                    spec.folder,
                    spec.tokenizer_id,
                    str(spec.vocab_size),
                ],
                pass_fds=(request_r, reply_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stderr (logs, tracebacks) stays the parent's
            )
        except BaseException:
            os.close(request_w)
            os.close(reply_r)
            raise
        finally:
            os.close(request_r)
            os.close(reply_w)
        return proc, Connection(request_w, readable=False), Connection(reply_r, writable=False)

    def compile(self, source: GrammarSource, limit_s: float) -> GrammarEntry | None:
        """The entry, or None past `limit_s` (the process is then killed)."""
        requests, replies = self._requests, self._replies
        if requests is None or replies is None or not self.alive:
            raise CompilerUnavailable(f"grammar compile process {self.index} is not running")
        try:
            requests.send_bytes(msgspec.msgpack.encode((source.kind, source.source)))
            if not replies.poll(limit_s):
                self.kill()
                return None
            reply = replies.recv_bytes()
        except (EOFError, OSError) as exc:
            proc = self._proc
            code = proc.poll() if proc is not None else None
            self.kill()
            raise CompilerUnavailable(
                f"grammar compile process {self.index} died while compiling (exit code {code})"
            ) from exc
        if reply.startswith(_CRASH):
            raise RuntimeError(reply[len(_CRASH) :].decode(errors="replace"))
        return GrammarEntry.from_bytes(reply[len(_ENTRY) :])

    def close(self, timeout_s: float) -> None:
        """End the process for good: its request pipe closed (it returns), killed if it
        does not within `timeout_s`."""
        with self._lock:
            self._closed = True
            proc, requests = self._proc, self._requests
            self._requests = None
        if requests is not None:
            requests.close()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        with self._lock:
            proc, requests, replies = self._proc, self._requests, self._replies
            self._proc, self._requests, self._replies = None, None, None
        _end(proc, requests, replies)


def _end(proc: subprocess.Popen[bytes] | None, *conns: Connection | None) -> None:
    """Close the pipes, kill the process, reap it."""
    for conn in conns:
        if conn is not None:
            conn.close()
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)


@dataclass
class ProcessCounters:
    stopped: int = 0  # compiles killed past the limit
    restarts: int = 0  # processes started again (after a stop or a death)


class CompileProcesses:
    """A `BuildEntry` over `processes` children, each compile limited to `limit_s`.

    Thread-safe; meant to be called from a thread pool of `processes` threads (the
    registry's executor), so a call finds a free child at once.
    """

    def __init__(
        self,
        spec: CompilerSpec,
        processes: int = 2,
        limit_s: float = 30.0,
        start_timeout_s: float = 120.0,
        on_stop: Callable[[str], None] | None = None,
    ) -> None:
        """`on_stop(kind)` is called (from the compiling thread) for each compile stopped."""
        if processes < 1:
            raise ValueError(f"need at least one compile process, got {processes}")
        if limit_s <= 0:
            raise ValueError(f"the compile limit must be > 0 s, got {limit_s}")
        self.spec = spec
        self.limit_s = limit_s
        self.counters = ProcessCounters()
        self._on_stop = on_stop
        self._closed = False
        self._children = [_Child(spec, i, start_timeout_s) for i in range(processes)]
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._start_all()

    def _start_all(self) -> None:
        """Start every child at once (each loads the tokenizer); raise if one fails."""
        errors: list[BaseException] = []

        def start(child: _Child) -> None:
            try:
                child.start()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(c,)) for c in self._children]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.close()
            raise errors[0]
        for child in self._children:
            self._idle.put(child)

    @property
    def pids(self) -> list[int | None]:
        return [child.pid for child in self._children]

    def __call__(self, source: GrammarSource) -> GrammarEntry:
        if self._closed:
            raise CompilerUnavailable("the grammar compile processes are closed")
        try:
            child = self._idle.get(timeout=ACQUIRE_TIMEOUT_S)
        except queue.Empty:
            raise CompilerUnavailable("no grammar compile process is free") from None
        restart_later = False
        try:
            started = time.monotonic()
            entry = self._compile_on(child, source)
            if entry is None:
                self.counters.stopped += 1
                restart_later = True
                log.warning(
                    "stopped compiling a %s grammar after %.1fs (limit %gs); its process restarts",
                    source.kind,
                    time.monotonic() - started,
                    self.limit_s,
                )
                if self._on_stop is not None:
                    self._on_stop(source.kind)
                return GrammarEntry(
                    kind=source.kind,
                    source=source.source,
                    tokenizer_id=self.spec.tokenizer_id,
                    error=too_long_message(self.limit_s),
                    stopped_at=time.time(),
                )
            return entry
        except CompilerUnavailable:
            restart_later = True
            raise
        finally:
            if restart_later and not self._closed:
                # The reply goes out now; the child is free again once it has restarted.
                threading.Thread(
                    target=self._restart,
                    args=(child,),
                    name="grammar-compile-restart",
                    daemon=True,
                ).start()
            else:
                self._idle.put(child)

    def _compile_on(self, child: _Child, source: GrammarSource) -> GrammarEntry | None:
        """Compile on `child`, started first if it is not running; once more in a new
        process if it dies meanwhile (it may have been dying already, killed while idle)."""
        for attempt in range(2):
            if not child.alive:
                self.counters.restarts += 1
                child.start()
            try:
                return child.compile(source, self.limit_s)
            except CompilerUnavailable as exc:
                if attempt or self._closed:  # closing kills the children: no new one
                    raise
                log.warning("%s; compiling in a new process", exc)
        raise AssertionError("unreachable")

    def _restart(self, child: _Child) -> None:
        try:
            self.counters.restarts += 1
            child.start()
        except Exception as exc:  # the next call that takes this child tries again
            if not self._closed:
                log.error("restarting grammar compile process %d failed: %s", child.index, exc)
        finally:
            self._idle.put(child)
            if self._closed:
                child.kill()

    def close(self, timeout_s: float = 2.0) -> None:
        self._closed = True
        for child in self._children:
            child.close(timeout_s)


if __name__ == "__main__":
    _in, _out, _folder, _tokenizer_id, _vocab = sys.argv[1:6]
    _child_main(
        Connection(int(_in), writable=False),
        Connection(int(_out), readable=False),
        CompilerSpec(_folder, _tokenizer_id, int(_vocab)),
    )
