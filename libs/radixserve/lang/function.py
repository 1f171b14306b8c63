"""`@function`: a frontend program, run once (`run`) or over many inputs at once
(`run_batch`, whose requests the server batches and whose shared prefixes its radix
cache holds once)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backends import Backend
from radixserve.lang.primitives import LangError
from radixserve.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs run against when `run` is given none."""
    global _default_backend
    _default_backend = backend


class Function:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Run the program on a fresh state; its generations run as they are appended."""
        state = ProgramState(_backend(backend))
        self.fn(state, *args, **kwargs)
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int = 16,
    ) -> list[ProgramState]:
        """One state per keyword set, in order, `num_threads` programs at a time; the first
        program that fails raises (after the others finished)."""
        chosen = _backend(backend)
        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            futures = [pool.submit(self.run, backend=chosen, **kw) for kw in batch_kwargs]
            return [f.result() for f in futures]

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Function:
    """Make `fn(s, ...)` a frontend program: `s` is its ProgramState."""
    return Function(fn)


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise LangError("no backend: pass backend=... or call set_default_backend first")
    return chosen
