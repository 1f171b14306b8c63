"""The interpreter's cyclic collector in a process that runs an engine.

A started engine holds hundreds of thousands of Python objects that live as long as
it does (the model's modules, captured graphs, kernels' launchers, buffers' wrappers).
Each full collection walks all of them: on the 8B shape ~0.3 s in which the host
launches nothing and the GPU idles. Once started, the engine moves them into the
collector's permanent generation (`gc.freeze()`, as vLLM and SGLang do after
start-up), so full collections walk only what requests create.

A step of a large batch also makes a few thousand short-lived objects (each request's
outputs), past the default young-generation threshold (700): one or two young
collections a step, ~1000 in a minute of decoding. The engine raises the threshold to
`YOUNG_THRESHOLD`, above what any step leaves alive at once; the process keeps it.

Frozen objects are never collected, even once garbage, so a shut-down engine thaws
them (`thaw`), and an engine sizing its KV pool from free GPU memory first collects
everything, frozen or not (`collect_all`): an engine dropped without shutdown may
still hold its memory through cycles frozen with it. The interpreter's exit thaws them
too, so that its last collection finalises them (nanobind's extensions, Triton's
among them, report objects left alive then as leaks).
"""

from __future__ import annotations

import atexit
import gc

YOUNG_THRESHOLD = 50_000


def settle_started_heap() -> int:
    """Collect, freeze every object alive now, and raise the young generation's
    threshold to YOUNG_THRESHOLD (a higher one is kept); the number frozen in all."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines start
    atexit.register(gc.unfreeze)
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:  # 0: collection disabled by the process's owner
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()


def thaw() -> None:
    """Put every frozen object back within the collector's reach (its next full
    collection frees those that are garbage by then)."""
    gc.unfreeze()


def collect_all() -> None:
    """A full collection that frees frozen garbage as well."""
    gc.unfreeze()
    gc.collect()
