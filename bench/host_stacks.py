"""Where a thread's time goes, by sampling its Python stack (no profiler hooks).

A background thread reads the watched thread's current frame every `interval_s`
(`sys._current_frames`) while `active` is set, and counts each function once per sample
in which it is on the stack (inclusive) and when it is the innermost frame (self). It
slows the watched thread only by the GIL hand-overs (the switch interval is lowered to
the sampling interval while `active`), unlike cProfile, which times every call and
inflates a step of ~1000 small Python calls several-fold. A sample taken while the
thread is inside C code (a kernel launch, an event's synchronize) lands on the Python
function that called it.

    sampler = StackSampler(threading.get_ident())
    with sampler:
        sampler.active = True
        ...  # the work to look at
        sampler.active = False
    print("\\n".join(sampler.report(top=30)))

`bench/offline.py --host-stacks FIRST LAST` samples the main thread over a window of
each run's steps.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from types import FrameType, TracebackType

MAX_DEPTH = 64  # frames walked from the innermost one


def frame_name(frame: FrameType) -> str:
    code = frame.f_code
    parts = code.co_filename.replace("\\", "/").rsplit("/", 2)
    where = "/".join(parts[-2:])
    return f"{where}:{code.co_firstlineno} {code.co_qualname}"


class StackSampler:
    def __init__(self, thread_id: int, interval_s: float = 0.0005) -> None:
        self.thread_id = thread_id
        self.interval_s = interval_s
        self._active = False
        self.samples = 0
        self.inclusive: Counter[str] = Counter()
        self.own: Counter[str] = Counter()
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

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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
        self.samples += 1
        self.own[names[0]] += 1
        self.inclusive.update(set(names))

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
