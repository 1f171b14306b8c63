"""Which asyncio event loop a service runs on.

`auto` (the default) runs uvloop where it is installed (a dependency on Linux and macOS)
and the standard loop elsewhere; `uvloop` requires it; `asyncio` is the standard loop,
for ruling uvloop out when chasing a problem. uvloop's transports and NATS/Redis reads
cost less CPU per message than the standard loop's, which is what the gateway and the
detokenizer spend theirs on (lab/notebook/2026-11-26-h100-uvloop-httptools.md).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

ENV_EVENT_LOOP = "RADIXSERVE_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def check_event_loop(choice: str) -> str:
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    return choice


def loop_factory(choice: str) -> tuple[str, LoopFactory | None]:
    """(the loop's name, a factory for asyncio.Runner; None: the standard loop)."""
    if check_event_loop(choice) == "asyncio":
        return "asyncio", None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError(
                f"{ENV_EVENT_LOOP}=uvloop but uvloop is not installed (pip install uvloop)"
            ) from None
        return "asyncio", None
    factory: LoopFactory = uvloop.new_event_loop
    return "uvloop", factory
