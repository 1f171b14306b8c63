"""Reading checkpoint tensors from a Hugging Face folder (single or sharded safetensors)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every shard, one at a time (memory-mapped)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
