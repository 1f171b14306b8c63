"""A server child process that does not outlive its parent.

    proc = ManagedProcess("redis-server", [path, "--port", "6379"], log_path)
    proc.start()
    proc.wait_ready(lambda: redis_answers("127.0.0.1", 6379), timeout_s=10)
    ...
    proc.stop(timeout_s=5)      # SIGTERM to the process group, SIGKILL after the timeout

Three layers keep children from leaking:

1. each child leads its own process group, and stop/kill signal the whole group
   (a terminal's Ctrl-C therefore reaches only the parent, which stops them in order);
2. an ``atexit`` hook stops every child still running when the interpreter exits;
3. on Linux the child asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to be
   killed when its parent dies, which covers a SIGKILLed parent. The kernel fires
   it when the *thread* that forked exits, so it is only armed for children started
   from the main thread; from any other thread layers 1 and 2 remain.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


class InfraError(RuntimeError):
    """A server binary is missing, exited at start, or never answered.

    ``binary`` is the path involved and ``output_tail`` the last lines the process
    wrote (stdout and stderr together), both also part of the message.
    """

    def __init__(self, message: str, *, binary: Path | None = None, output_tail: str = "") -> None:
        text = message
        if binary is not None:
            text += f"\n  binary: {binary}"
        if output_tail:
            text += "\n  last output:\n" + textwrap.indent(output_tail, "    ")
        super().__init__(text)
        self.binary = binary
        self.output_tail = output_tail


class ManagedProcess:
    """One child process in its own process group; see the module docstring."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`env`: variables set for the child on top of this process's environment."""
        if not argv:
            raise ValueError("argv must name a binary")
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env or {})
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        libc = _libc()
        parent_pid = os.getpid()
        with open(self.log_path, "ab") as log:
            try:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    env={**os.environ, **self.env} if self.env else None,
                    preexec_fn=lambda: _in_child(libc, parent_pid),
                )
            except OSError as exc:
                raise InfraError(
                    f"cannot execute {self.name}: {exc}", binary=Path(self.argv[0])
                ) from exc
        _LIVE.add(self)

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``probe`` until it is true; raise InfraError if the process exits or
        the timeout passes (the process is then stopped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._popen is None or self._popen.poll() is not None:
                code = None if self._popen is None else self._popen.returncode
                self._forget()
                raise InfraError(
                    f"{self.name} exited at start (exit code {code})",
                    binary=Path(self.argv[0]),
                    output_tail=self.output_tail(),
                )
            if probe():
                return
            if time.monotonic() >= deadline:
                self.stop(timeout_s=2.0)
                raise InfraError(
                    f"{self.name} did not answer within {timeout_s:.1f}s",
                    binary=Path(self.argv[0]),
                    output_tail=self.output_tail(),
                )
            time.sleep(_POLL_S)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM the group, wait up to ``timeout_s``, then SIGKILL it. Idempotent."""
        popen = self._popen
        if popen is None:
            return
        if popen.poll() is None:
            _signal_group(popen.pid, signal.SIGTERM)
            try:
                popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(popen.pid, signal.SIGKILL)
                popen.wait(timeout=timeout_s)
        self._forget()

    def kill(self) -> None:
        """SIGKILL the group at once (a crash, for tests) and reap the child."""
        popen = self._popen
        if popen is None:
            return
        if popen.poll() is None:
            _signal_group(popen.pid, signal.SIGKILL)
            popen.wait(timeout=10.0)
        self._forget()

    def output_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _forget(self) -> None:
        _LIVE.discard(self)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # The child called setpgid(0, 0), so its pid is its group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _libc() -> ctypes.CDLL | None:
    # Loaded in the parent: the child between fork and exec should do as little as possible.
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        # A worker thread that ends would take the server with it (see module docstring).
        return None
    return ctypes.CDLL(None, use_errno=True)


def _in_child(libc: ctypes.CDLL | None, parent_pid: int) -> None:
    os.setpgid(0, 0)
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            # The parent died before prctl took effect; nobody would ever stop us.
            os._exit(1)


class _LiveSet:
    """Children still running, for the atexit fallback."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[ManagedProcess] = set()

    def add(self, proc: ManagedProcess) -> None:
        with self._lock:
            self._procs.add(proc)

    def discard(self, proc: ManagedProcess) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop(timeout_s=2.0)


_LIVE = _LiveSet()
atexit.register(_LIVE.stop_all)
