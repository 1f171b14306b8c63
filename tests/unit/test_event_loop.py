"""A service's event loop: `auto` takes uvloop where installed, `asyncio` the standard
loop, `uvloop` requires it; a bad name is refused where the settings are made."""

from __future__ import annotations

import asyncio
import sys

import pytest

from radixserve.services.event_loop import loop_factory
from radixserve.services.runtime import ServiceSettings


def _loop_type(choice: str) -> str:
    _, factory = loop_factory(choice)

    async def running() -> str:
        return type(asyncio.get_running_loop()).__module__

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(running())


def test_auto_and_uvloop_run_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    assert loop_factory("auto")[0] == loop_factory("uvloop")[0] == "uvloop"
    assert _loop_type("auto").startswith("uvloop")
    assert _loop_type("uvloop").startswith("uvloop")


def test_asyncio_runs_the_standard_loop() -> None:
    assert loop_factory("asyncio") == ("asyncio", None)
    assert _loop_type("asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory("auto") == ("asyncio", None)
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_settings_take_the_variable_and_refuse_a_bad_name() -> None:
    env = {"RADIXSERVE_EVENT_LOOP": "AsyncIO"}
    assert ServiceSettings.from_env("unit", env).event_loop == "asyncio"
    assert ServiceSettings.from_env("unit", {}).event_loop == "auto"
    assert ServiceSettings.from_env("unit", env, event_loop="uvloop").event_loop == "uvloop"
    with pytest.raises(ValueError, match="event loop must be one of auto, uvloop, asyncio"):
        ServiceSettings.from_env("unit", {"RADIXSERVE_EVENT_LOOP": "trio"})
