"""HiCache's third tier: KV blocks in a directory that several workers share.

A block is `block_size` tokens (the KV events' blocks, `kvcache/block_events.py`), named
by the same chained hash (`protocol.kv_events.block_hashes`): the hash names the whole
prefix up to the block's end, so any worker serving the same model can load a prefix
another one computed, or one it computed before a restart. Blocks live under a
namespace that names the model and the KV layout, one file each, written to a temporary
name and renamed (a reader never sees half a block; two writers of one block write the
same bytes). Nothing here deletes: the directory is the operator's to size and prune
(a cron `find -atime`), and a missing or unreadable block is a miss.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class FileBlockStore:
    def __init__(self, root: str | Path, namespace: str, block_shape: tuple[int, ...]) -> None:
        """`block_shape`: one block's KV as bytes (gather_rows' shape for block_size slots)."""
        self.block_shape = block_shape
        self.block_bytes = 1
        for n in block_shape:
            self.block_bytes *= n
        layout = "x".join(map(str, block_shape))
        tag = hashlib.blake2b(f"{namespace}|{layout}".encode(), digest_size=8).hexdigest()
        self.directory = Path(root) / tag
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: int) -> Path:
        name = (block_hash & (2**64 - 1)).to_bytes(8, "big").hex()
        return self.directory / name[:2] / f"{name}.kv"

    def contains(self, block_hash: int) -> bool:
        return self._path(block_hash).is_file()

    def read(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV bytes (block_shape, uint8, on the CPU), or None if it is missing
        or not a whole block."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) != self.block_bytes:
            log.warning(
                "KV block %s has %d bytes, not %d: ignored", path, len(data), self.block_bytes
            )
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.block_shape)

    def write(self, block_hash: int, rows: torch.Tensor) -> bool:
        """Store a block (block_shape, uint8, on the CPU) unless it is there already.
        False if it could not be written (a full or read-only disk: logged, not raised,
        since the block is only a copy)."""
        path = self._path(block_hash)
        if path.is_file():
            return True
        assert tuple(rows.shape) == self.block_shape and rows.dtype == torch.uint8
        tmp: str | None = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(rows.contiguous().numpy().tobytes())
            os.replace(tmp, path)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            log.warning("KV block store %s: could not write a block: %s", self.directory, exc)
            return False
        return True
