"""HiCache's second tier: a KV pool in host memory, and the copies between it and the device's.

The host pool is a `KVPool` on the CPU with the device pool's layout (layers, KV heads,
head size, dtype and page size; FP8 codes stay codes: a layer's scales are the same on
both sides), pinned when the device pool is on a GPU. Copies move whole slots of every
layer, K and V, as raw bytes.

On CUDA a copy to the host waits for the device (the KV must have been written, and the
host reads what arrived); one to the device does not: it goes from pinned memory on the
current stream, ordered after every kernel queued before it and before every one queued
after, so a request's prefill reads the loaded KV.
"""

from __future__ import annotations

import os

import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.kvcache.block_events import event_block_size
from radixserve.engine.kvcache.block_store import FileBlockStore
from radixserve.engine.kvcache.pool import KVPool

# A copy moves at most this many slots at a time, bounding its staging tensor (every
# layer's K and V of those slots: ~256 MiB for an 8B model's 2048 tokens in bf16).
COPY_CHUNK_SLOTS = 2048
# The host pool may take at most this share of the machine's memory.
MAX_HOST_SHARE = 0.9


def host_pool_for(device_pool: KVPool, size_gb: float) -> KVPool:
    """A host pool of `size_gb` GiB with `device_pool`'s layout."""
    k = device_pool.k_buffers[0]
    per_token = KVPool.bytes_per_token_for(device_pool.num_layers, k.shape[1], k.shape[2], k.dtype)
    num_slots = int(size_gb * 2**30) // per_token
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size_gb * 2**30 > MAX_HOST_SHARE * total:
        raise ValueError(
            f"hicache_size_gb {size_gb:g} is more than {MAX_HOST_SHARE:.0%} of this machine's "
            f"{total / 2**30:.1f} GiB of memory"
        )
    if num_slots < 2 * device_pool.page_size:
        raise ValueError(
            f"hicache_size_gb {size_gb:g} holds {num_slots} tokens of KV ({per_token} bytes "
            f"each): fewer than two pages of {device_pool.page_size}"
        )
    return KVPool(
        num_slots,
        device_pool.num_layers,
        k.shape[1],
        k.shape[2],
        k.dtype,
        "cpu",
        page_size=device_pool.page_size,
        pin_memory=device_pool.device.type == "cuda",
    )


def block_store_for(config: EngineConfig, device_pool: KVPool) -> FileBlockStore:
    """The shared block store under `config.hicache_storage_dir`, in a namespace of the
    model and the options that change its KV: workers serving the same model path with
    the same options share blocks."""
    assert config.hicache_storage_dir
    model = os.path.realpath(config.model_path) if config.model_path else "embedded"
    weights = config.random_seed if config.load_format == "dummy" else config.load_format
    namespace = "|".join(
        map(str, (model, weights, config.quantization, config.gguf_weights, device_pool.dtype))
    )
    block = event_block_size(device_pool.page_size)
    shape = tuple(
        gather_rows(
            device_pool, torch.zeros(block, dtype=torch.int64, device=device_pool.device)
        ).shape
    )
    return FileBlockStore(config.hicache_storage_dir, namespace, shape)


def _buffers(pool: KVPool) -> list[torch.Tensor]:
    # Raw bytes: index_select and index_copy_ do not take every dtype (float8 on the CPU).
    return [b.view(torch.uint8) for b in (*pool.k_buffers, *pool.v_buffers)]


def gather_rows(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """The KV of `slots`, every layer's K then V, as bytes: [2 * layers, n, heads, row bytes]
    on the pool's device."""
    return torch.stack([b.index_select(0, slots) for b in _buffers(pool)])


def scatter_rows(pool: KVPool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` (as gather_rows gives them, on any device) into `slots` of `pool`."""
    if rows.device != pool.device:
        pinned = pool.device.type == "cuda"
        rows = (rows.pin_memory() if pinned else rows).to(pool.device, non_blocking=pinned)
    for buffer, layer_rows in zip(_buffers(pool), rows, strict=True):
        buffer.index_copy_(0, slots, layer_rows)


def copy_to_host(
    device: KVPool, device_slots: torch.Tensor, host: KVPool, host_slots: torch.Tensor
) -> None:
    """Write the KV of `device_slots` into `host_slots` (same length), every layer."""
    host_slots = host_slots.cpu()
    for start in range(0, device_slots.numel(), COPY_CHUNK_SLOTS):
        src = device_slots[start : start + COPY_CHUNK_SLOTS]
        dst = host_slots[start : start + COPY_CHUNK_SLOTS]
        scatter_rows(host, dst, gather_rows(device, src).cpu())


def copy_to_device(
    host: KVPool, host_slots: torch.Tensor, device: KVPool, device_slots: torch.Tensor
) -> None:
    """Write the KV of `host_slots` into `device_slots` (same length), every layer."""
    host_slots = host_slots.cpu()
    for start in range(0, host_slots.numel(), COPY_CHUNK_SLOTS):
        src = host_slots[start : start + COPY_CHUNK_SLOTS]
        dst = device_slots[start : start + COPY_CHUNK_SLOTS]
        scatter_rows(device, dst, gather_rows(host, src))
