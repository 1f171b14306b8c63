"""Reading checkpoint tensors from a Hugging Face folder (single or sharded safetensors),
whole or a tensor-parallel rank's part alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's shard files: from the index json when there is one, else every *.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder} (only safetensors is supported)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shards named by the index are missing: {missing}")
    return files


class StoredTensor:
    """One checkpoint tensor, read when asked for: whole, or one range of one dimension
    (a tensor-parallel rank's rows or columns, read alone from the file)."""

    def __init__(self, shard: Any, name: str) -> None:
        self._shard = shard  # an open safe_open handle
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._shard.get_slice(self.name).get_shape())

    def read(self) -> torch.Tensor:
        return self._shard.get_tensor(self.name)

    def read_range(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Indices [start, start + length) of dimension `dim`, the others whole."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._shard.get_slice(self.name)[index]


def iter_safetensors(folder: str | Path) -> Iterator[StoredTensor]:
    """Every tensor of every shard, one at a time (memory-mapped; read while the
    iteration is on it)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                yield StoredTensor(shard, name)
