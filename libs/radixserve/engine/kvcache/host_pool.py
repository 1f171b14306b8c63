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


def _buffers(pool: KVPool) -> list[torch.Tensor]:
    # Raw bytes: index_select and index_copy_ do not take every dtype (float8 on the CPU).
    return [b.view(torch.uint8) for b in (*pool.k_buffers, *pool.v_buffers)]


def copy_to_host(
    device: KVPool, device_slots: torch.Tensor, host: KVPool, host_slots: torch.Tensor
) -> None:
    """Write the KV of `device_slots` into `host_slots` (same length), every layer."""
    host_slots = host_slots.cpu()
    sources, targets = _buffers(device), _buffers(host)
    for start in range(0, device_slots.numel(), COPY_CHUNK_SLOTS):
        src = device_slots[start : start + COPY_CHUNK_SLOTS]
        dst = host_slots[start : start + COPY_CHUNK_SLOTS]
        staged = torch.stack([b.index_select(0, src) for b in sources]).cpu()
        for buffer, rows in zip(targets, staged, strict=True):
            buffer.index_copy_(0, dst, rows)


def copy_to_device(
    host: KVPool, host_slots: torch.Tensor, device: KVPool, device_slots: torch.Tensor
) -> None:
    """Write the KV of `host_slots` into `device_slots` (same length), every layer."""
    host_slots = host_slots.cpu()
    sources, targets = _buffers(host), _buffers(device)
    pinned = device.device.type == "cuda"
    for start in range(0, host_slots.numel(), COPY_CHUNK_SLOTS):
        src = host_slots[start : start + COPY_CHUNK_SLOTS]
        dst = device_slots[start : start + COPY_CHUNK_SLOTS]
        staged = torch.stack([b.index_select(0, src) for b in sources])
        if pinned:
            staged = staged.pin_memory()
        staged = staged.to(device.device, non_blocking=pinned)
        for buffer, rows in zip(targets, staged, strict=True):
            buffer.index_copy_(0, dst, rows)
