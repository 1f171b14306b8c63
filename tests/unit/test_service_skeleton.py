"""Every service module has the one skeleton `radixserve serve NAME` runs
(`runtime.ServiceModule`): `add_arguments`, `settings_from` (cheap, all the flag reading
and checking) giving a frozen `<Name>Settings` with the common `ServiceSettings` as
`service`, and `async def start(ctx, settings)`; no `run` of its own."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
from types import ModuleType
from typing import Any

import pytest

from radixserve.cli import SERVICES
from radixserve.services.runtime import ServiceSettings, add_common_arguments


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"radixserve.services.{name}")


def _settings(module: ModuleType, argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    module.add_arguments(parser)
    return module.settings_from(parser.parse_args(argv))


@pytest.mark.parametrize("name", SERVICES)
def test_the_service_module_has_the_skeleton(name: str) -> None:
    module = _module(name)
    assert callable(module.add_arguments)
    assert callable(module.settings_from)
    assert inspect.iscoroutinefunction(module.start)
    assert list(inspect.signature(module.start).parameters) == ["ctx", "settings"]
    assert not hasattr(module, "run")


@pytest.mark.parametrize("name", SERVICES)
def test_settings_from_gives_frozen_settings_with_the_common_part(name: str) -> None:
    settings = _settings(_module(name), [])
    assert dataclasses.is_dataclass(settings) and not isinstance(settings, type)
    assert type(settings).__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert isinstance(settings.service, ServiceSettings)
    assert settings.service.service == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.service = settings.service


def test_a_bad_flag_value_is_refused_as_before() -> None:
    with pytest.raises(SystemExit, match="--engine-stall-s must be >= 0, got -1"):
        _settings(_module("worker"), ["--engine-stall-s", "-1"])
