"""A wall-clock stack sampler for the stack's service processes (bench/overhead.py
--sample DIR puts this folder on their PYTHONPATH and sets RADIXSERVE_SAMPLE_DIR).

Every 2 ms a daemon thread reads every thread's Python stack (sys._current_frames) and
counts (thread name, innermost frames); every 5 s, and at exit, it writes the counts to
DIR/<service>-<pid>.txt, most frequent first. A thread blocked in C (a CUDA sync, a
socket, waiting for the GIL) shows the Python frame it is blocked in, so the counts are
where each thread spends its wall time, not only its CPU time. Nothing here runs unless
the variable is set.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time

_DIR = os.environ.get("RADIXSERVE_SAMPLE_DIR")
_DEPTH = 8
_PERIOD_S = 0.002


def _service_name() -> str:
    argv = sys.argv
    for name in ("worker", "gateway", "detokenizer", "tokenizer", "scheduler", "grammar"):
        if name in argv:
            return name
    return os.path.basename(argv[0]) if argv and argv[0] else "python"


def _start(out_dir: str) -> None:
    counts: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
    path = os.path.join(out_dir, f"{_service_name()}-{os.getpid()}.txt")

    def dump() -> None:
        total = sum(counts.values()) or 1
        by_thread: collections.Counter[str] = collections.Counter()
        for (thread, _), n in counts.items():
            by_thread[thread] += n
        lines = [f"samples {total} (every {_PERIOD_S * 1e3:.0f} ms)"]
        lines += [f"thread {t}: {n} ({100 * n / total:.1f}%)" for t, n in by_thread.most_common()]
        for (thread, stack), n in counts.most_common(60):
            lines.append(f"\n{n} ({100 * n / by_thread[thread]:.1f}% of {thread})")
            lines += [f"    {frame}" for frame in stack]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def run() -> None:
        me = threading.get_ident()
        last_dump = time.monotonic()
        while True:
            time.sleep(_PERIOD_S)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                f = frame
                while f is not None and len(stack) < _DEPTH:
                    code = f.f_code
                    stack.append(
                        f"{code.co_name} ({os.path.basename(code.co_filename)}:{f.f_lineno})"
                    )
                    f = f.f_back
                counts[(names.get(ident, str(ident)), tuple(stack))] += 1
            if time.monotonic() - last_dump > 5.0:
                dump()
                last_dump = time.monotonic()

    threading.Thread(target=run, name="stack-sampler", daemon=True).start()
    atexit.register(dump)


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _start(_DIR)
