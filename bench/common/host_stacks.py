"""Where a thread's time goes, by sampling its Python stack (no profiler hooks).

A background thread reads the watched thread's current frame every `interval_s`
(`sys._current_frames`) while `active` is set, and counts each function once per sample
in which it is on the stack (inclusive) and when it is the innermost frame (self). It
slows the watched thread by the GIL hand-overs alone (the switch interval is lowered to
the sampling interval while `active`), where cProfile times every call and inflates a
step of ~1000 small Python calls several-fold. Those hand-overs still cost: at 0.5 ms
the engine's host took ~1.5x as long a mixed step on the H100 (62 against 42 ms); a
longer interval costs less for fewer samples. A sample taken while the
thread is inside C code (a kernel launch, an event's synchronize) lands on the Python
function that called it.

    sampler = StackSampler(threading.get_ident())
    with sampler:
        sampler.active = True
        ...  # the work to look at
        sampler.active = False
    print("\\n".join(sampler.tally().report(top=30)))

`bench/offline.py --host-stacks FIRST LAST` samples the main thread over a window of
each run's steps, tallied by step: the whole window, and the steps in it where the host
spent longest on its own work.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType

MAX_DEPTH = 64  # frames walked from the innermost one


def frame_name(frame: FrameType) -> str:
    code = frame.f_code
    parts = code.co_filename.replace("\\", "/").rsplit("/", 2)
    where = "/".join(parts[-2:])
    return f"{where}:{code.co_firstlineno} {code.co_qualname}"


@dataclass
class Tally:
    """Samples of one step (or of several, merged): each function counted once per
    sample on the stack (inclusive) and when innermost (own)."""

    samples: int = 0
    inclusive: Counter[str] = field(default_factory=Counter)
    own: Counter[str] = field(default_factory=Counter)

    def add(self, names: list[str]) -> None:
        self.samples += 1
        self.own[names[0]] += 1
        self.inclusive.update(set(names))

    def merge(self, other: Tally) -> None:
        self.samples += other.samples
        self.inclusive.update(other.inclusive)
        self.own.update(other.own)

    def report(self, top: int = 30) -> list[str]:
        """The `top` functions by inclusive samples, each with its share of all samples
        on the stack and as the innermost frame."""
        if not self.samples:
            return ["no samples"]
        lines = [f"{self.samples} samples; share on the stack / innermost"]
        for name, count in self.inclusive.most_common(top):
            lines.append(
                f"  {100 * count / self.samples:5.1f}% {100 * self.own[name] / self.samples:5.1f}%"
                f"  {name}"
            )
        return lines


class StackSampler:
    """Samples one thread's stack while `active`, tallied by `step` (a label the caller
    sets, e.g. the index of the engine step it is in)."""

    def __init__(self, thread_id: int, interval_s: float = 0.0005) -> None:
        self.thread_id = thread_id
        self.interval_s = interval_s
        self.step = 0
        self.by_step: dict[int, Tally] = {}
        self._active = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch = sys.getswitchinterval()

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        """Sample from now (`True`) or stop (`False`); the switch interval is lowered
        only while sampling, so the watched thread runs as usual outside the window."""
        if on != self._active:
            self._active = on
            sys.setswitchinterval(min(self._switch, self.interval_s) if on else self._switch)

    def __enter__(self) -> StackSampler:
        self._switch = sys.getswitchinterval()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="host-stacks", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.active:
                self.take()

    def take(self) -> None:
        """One sample of the watched thread's stack (nothing if it has no frame)."""
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return
        names: list[str] = []
        while frame is not None and len(names) < MAX_DEPTH:
            names.append(frame_name(frame))
            frame = frame.f_back
        self.by_step.setdefault(self.step, Tally()).add(names)

    def tally(self, steps: Iterable[int] | None = None) -> Tally:
        """The samples of `steps` (all where None), merged."""
        merged = Tally()
        for step in self.by_step if steps is None else steps:
            if step in self.by_step:
                merged.merge(self.by_step[step])
        return merged
