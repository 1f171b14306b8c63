"""The keys file: hashed API keys in JSON, as a mounted secret holds them.

    {"keys": [{"name": "admin", "sha256": "<hex>", "scopes": ["inference", "admin"],
               "rpm": null, "tpm": null, "priority": null}]}

    keys = KeyFile(path)          # loads it (a bad file is an error at start)
    keys.lookup(sha256)           # ApiKey | None
    await keys.watch(1.0)         # reloads on change; a bad new version keeps the old

`write_keys` replaces the file in one rename, mode 0600, so a reader never sees half
of it. A Kubernetes secret volume swaps a symlink: `stat` of the path sees the change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from radixserve.auth.keys import ApiKey

log = logging.getLogger(__name__)


class KeyFileError(ValueError):
    """The keys file cannot be read or is not valid."""


def read_keys(path: Path) -> list[ApiKey]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyFileError(f"cannot read the keys file {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise KeyFileError(f"the keys file {path} is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("keys"), list):
        raise KeyFileError(f'the keys file {path} must be an object with a "keys" list')
    keys: list[ApiKey] = []
    for index, entry in enumerate(raw["keys"]):
        try:
            keys.append(ApiKey.from_dict(entry))
        except ValueError as exc:
            raise KeyFileError(f"the keys file {path}, keys[{index}]: {exc}") from exc
    for what in ("name", "sha256"):
        values = [getattr(k, what) for k in keys]
        if len(set(values)) != len(values):
            raise KeyFileError(f"the keys file {path} has two keys of the same {what}")
    return keys


def write_keys(path: Path, keys: Iterable[ApiKey]) -> None:
    body = json.dumps({"keys": [k.to_dict() for k in keys]}, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:  # mkstemp makes it 0600
            out.write(body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class KeyFile:
    """The keys of one file, by hash; `reload` picks up a changed file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature = _signature(path)
        self._by_hash = {k.sha256: k for k in read_keys(path)}

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, sha256: str) -> ApiKey | None:
        return self._by_hash.get(sha256)

    def reload(self) -> bool:
        """Read the file again if it changed; True when new keys were taken. A file
        that is gone or invalid keeps the keys there were (and is logged)."""
        signature = _signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            keys = read_keys(self.path)
        except KeyFileError as exc:
            log.error("keeping the %d keys loaded before: %s", len(self._by_hash), exc)
            return False
        self._by_hash = {k.sha256: k for k in keys}
        log.info("reloaded %d API keys from %s", len(keys), self.path)
        return True

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.reload)  # a read of a mounted volume may stall
