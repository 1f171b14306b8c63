"""HiCache: the radix tree over two tiers, the device's KV pool and a host pool under it.

A node's KV is on the device (`value`), in host memory (`host_value`), or both. What is
on the device is a subtree from the root (a match's device slots are one run), and
below it a node may live on the host alone; locks protect device KV only.

- Device eviction takes unlocked nodes with no child on the device, least recently used
  first, as the plain tree does; each keeps its place in the tree with its KV in host
  memory (copied there now, "write_back", or at insert, "write_through"). Only a node
  the host pool has no room for leaves the tree, with what hangs below it.
- Host eviction, when the host pool needs room, takes the least recently used of: a
  copy of a node that is on the device too (dropped), or a host-only leaf (it leaves
  the tree, and its blocks leave the KV events).
- `match_prefix(load=True)` brings the host-only nodes of a match back to the device
  before the request's prefill, node by node while device memory allows; the host copy
  stays, so evicting the node again costs no copy.
- An insert through host-only nodes gives them the request's device slots (it computed
  that KV itself when the match did not load it).

The KV events report a block as stored while either tier holds it: a host hit is still
far cheaper than computing the prefix.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.engine.config import HICACHE_WRITE_POLICIES as WRITE_POLICIES
from radixserve.engine.kvcache.base import MatchResult
from radixserve.engine.kvcache.block_events import event_block_size
from radixserve.engine.kvcache.block_store import FileBlockStore
from radixserve.engine.kvcache.host_pool import (
    copy_to_device,
    copy_to_host,
    gather_rows,
    scatter_rows,
)
from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.kvcache.radix_cache import RadixCache, TreeNode
from radixserve.protocol.kv_events import KvEvent, OffloadedBlocks, block_hashes


@dataclass(frozen=True)
class HostCacheStats:
    """Totals since start (the host tier's metrics)."""

    host_size_tokens: int
    host_used_tokens: int
    bytes_per_token: int
    loaded_tokens: int = 0  # host hits: tokens brought back to the device for a request
    written_tokens: int = 0  # tokens copied to host memory
    dropped_tokens: int = 0  # tokens that left both tiers
    load_seconds: float = 0.0  # host time spent bringing KV back (queued copies on CUDA)
    write_seconds: float = 0.0
    # The shared store (L3), when there is one.
    store_loaded_tokens: int = 0  # store hits: tokens read back for a request
    store_written_tokens: int = 0
    store_load_seconds: float = 0.0
    store_write_seconds: float = 0.0


class HiRadixCache(RadixCache):
    def __init__(
        self,
        kv_pool: KVPool,
        host_pool: KVPool,
        write_policy: str = "write_back",
        store: FileBlockStore | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if host_pool.page_size != kv_pool.page_size or host_pool.dtype != kv_pool.dtype:
            raise ValueError("the host KV pool must have the device pool's page size and dtype")
        self.host_pool = host_pool
        self.write_policy = write_policy
        k = kv_pool.k_buffers[0]
        self._bytes_per_token = KVPool.bytes_per_token_for(
            kv_pool.num_layers, k.shape[1], k.shape[2], k.dtype
        )
        self._loaded = self._written = self._dropped = 0
        self._load_s = self._write_s = 0.0
        self.store = store
        self.store_block = event_block_size(kv_pool.page_size)
        self._store_loaded = self._store_written = 0
        self._store_load_s = self._store_write_s = 0.0
        super().__init__(kv_pool)

    def _init_tree(self) -> None:
        super()._init_tree()
        # (last_access_time, node_id, node) of every node with host KV, among stale
        # entries; an entry older than its node's time is pushed again when it surfaces.
        self._host_candidates: list[tuple[int, int, TreeNode]] = []
        self._host_nodes = 0
        self._loading: set[int] = set()  # nodes being loaded: not to be host-evicted

    def reset(self) -> None:
        super().reset()
        self.host_pool.clear()

    def snapshot_events(self) -> list[KvEvent]:
        events = super().snapshot_events()
        offloaded = [b for n in self._nodes() if n.value is None for b in n.blocks]
        if offloaded:
            events.append(OffloadedBlocks(block_hashes=offloaded))
        return events

    # -- lookup and insertion ----------------------------------------------------
    def match_prefix(self, key: Sequence[int], load: bool = False) -> MatchResult:
        key = key[: len(key) // self.page_size * self.page_size]
        _, _, path = self._walk(key)
        on_device = self._device_part(path)
        if load and on_device < len(path):
            self._load_back(path[on_device - 1] if on_device else self._root, path[on_device:])
            on_device = self._device_part(path)
        if load and self.store is not None and on_device == len(path):
            if self._load_from_store(key, path):
                _, _, path = self._walk(key)
                on_device = self._device_part(path)
        deepest = path[on_device - 1] if on_device else self._root
        self._offer(deepest)  # touched by the walk: a stale entry no longer holds
        host_length = sum(len(n.key) for n in path[on_device:])
        return MatchResult(self._slots_of(path), deepest, host_length=host_length)

    @staticmethod
    def _device_part(path: list[TreeNode]) -> int:
        """How many of `path`'s first nodes are on the device (the rest are not)."""
        return sum(1 for n in path if n.value is not None)

    def _load_back(self, anchor: TreeNode, host_nodes: list[TreeNode]) -> None:
        """Bring `host_nodes` (a path below `anchor`, the deepest device node) to the
        device in order, while slots can be had; each stays locked until the next is in,
        so making room for one never evicts the ones before it."""
        started = time.perf_counter()
        self._loading = {id(n) for n in host_nodes}
        self.inc_lock_ref(anchor)
        held = anchor
        try:
            for node in host_nodes:
                assert node.host_value is not None
                need = len(node.key)
                short = need - self.kv_pool.available()
                if short > 0:
                    self.evict(short)
                slots = self.kv_pool.alloc(need)
                if slots is None:
                    break
                copy_to_device(self.host_pool, node.host_value, self.kv_pool, slots)
                node.value = slots
                if self.events is not None:
                    self.events.restored(node.blocks)
                self._evictable_tokens += need
                self._loaded += need
                self.inc_lock_ref(node)
                self.dec_lock_ref(held)
                held = node
        finally:
            self._loading = set()
            self.dec_lock_ref(held)
            for node in host_nodes:
                self._offer_host(node)
            self._load_s += time.perf_counter() - started

    def _load_from_store(self, key: Sequence[int], path: list[TreeNode]) -> bool:
        """Read the store's blocks that continue `path` (all on the device) along `key`
        into fresh device slots and cache them; whether any were."""
        assert self.store is not None
        size = self.store_block
        matched = sum(len(n.key) for n in path)
        hashes = block_hashes(key[: len(key) // size * size], size)
        first = matched // size
        found = first
        while found < len(hashes) and self.store.contains(hashes[found]):
            found += 1
        end = found * size
        if end <= matched:
            return False
        started = time.perf_counter()
        anchor = path[-1] if path else self._root
        self.inc_lock_ref(anchor)
        try:
            short = end - matched - self.kv_pool.available()
            if short > 0:
                self.evict(short)
            slots = self.kv_pool.alloc(end - matched)
            if slots is None:
                return False
            blocks = [self.store.read(h) for h in hashes[first:found]]
            if any(b is None for b in blocks):  # pruned meanwhile: a miss
                self.kv_pool.free(slots)
                return False
            rows = torch.cat([b for b in blocks if b is not None], dim=1)
            scatter_rows(self.kv_pool, slots, rows[:, matched - first * size :])
            self.insert(key[:end], torch.cat([self._slots_of(path), slots]))
        finally:
            self.dec_lock_ref(anchor)
        self._store_loaded += end - matched
        self._store_load_s += time.perf_counter() - started
        return True

    def _write_to_store(self, node: TreeNode) -> None:
        """Put the store's blocks that end inside `node` (on the device, as is its path)."""
        assert self.store is not None and node.parent is not None
        size = self.store_block
        first, end = node.parent.depth // size, node.depth // size
        if end <= first:
            return
        started = time.perf_counter()
        path: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk is not self._root:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        assert all(n.value is not None for n in path), "a path to store is on the device"
        tokens = [t for n in path for t in n.key]
        slots = self._slots_of(path)
        hashes = block_hashes(tokens[: end * size], size)
        for b in range(first, end):
            if not self.store.contains(hashes[b]):
                rows = gather_rows(self.kv_pool, slots[b * size : (b + 1) * size]).cpu()
                if self.store.write(hashes[b], rows):
                    self._store_written += size
        self._store_write_s += time.perf_counter() - started

    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        self._check_insert_args(key, indices)
        node, pos, path = self._walk(key)
        cached = pos
        start = 0
        for n in path:  # host-only nodes: the request computed their KV (no load)
            if n.value is None:
                cached = min(cached, start)
                n.value = indices[start : start + len(n.key)].clone()
                self._evictable_tokens += len(n.key)
                if self.events is not None:
                    self.events.restored(n.blocks)
                self._offer_host(n)  # on both tiers now: its copy may be dropped
            start += len(n.key)
        if path:
            self._offer(path[-1])
        if pos < len(key):
            leaf = self._add_leaf(node, key, pos, indices)
            if self.write_policy == "write_through":
                self._write_to_host(leaf)
        return cached

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        upper = super()._split(child, n)
        if upper.host_value is not None:
            self._host_nodes += 1
            self._offer_host(upper)
        return upper

    # -- eviction ----------------------------------------------------------------
    def _evictable(self, node: TreeNode) -> bool:
        return (
            node is not self._root
            and node.value is not None
            and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        heap = self._candidates
        freed = 0
        while freed < num_tokens and heap:
            touched, _, node = heapq.heappop(heap)
            if not self._holds(touched, node):
                continue
            parent = node.parent
            assert parent is not None and node.value is not None
            if node.host_value is None:
                self._write_to_host(node)
            self.kv_pool.free(node.value)
            node.value = None
            self._evictable_tokens -= len(node.key)
            freed += len(node.key)
            if node.host_value is None:  # no room on the host: it leaves the tree
                self._remove_subtree(node)
            elif self.events is not None:
                self.events.offloaded(node.blocks)
            self._offer(parent)
        return freed

    def _write_to_host(self, node: TreeNode) -> None:
        """Copy `node`'s device KV to host memory, if the host pool has (or can make) room."""
        assert node.value is not None and node.host_value is None
        need = len(node.key)
        short = need - self.host_pool.available()
        if short > 0:
            self._evict_host(short)
        slots = self.host_pool.alloc(need)
        if slots is None:
            return
        started = time.perf_counter()
        copy_to_host(self.kv_pool, node.value, self.host_pool, slots)
        self._write_s += time.perf_counter() - started
        if self.store is not None:
            self._write_to_store(node)
        self._written += need
        node.host_value = slots
        self._host_nodes += 1
        self._offer_host(node)

    def _evict_host(self, num_tokens: int) -> None:
        heap = self._host_candidates
        freed = 0
        kept: list[tuple[int, int, TreeNode]] = []
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            touched, _, node = entry
            if node.parent is None or node.host_value is None:
                continue  # gone, or its copy already dropped
            if id(node) in self._loading:
                kept.append(entry)
            elif node.last_access_time != touched:
                heapq.heappush(heap, (node.last_access_time, node.node_id, node))
            elif node.value is not None:  # on the device too: drop the copy
                freed += self._drop_host_copy(node)
            elif not node.children:
                freed += len(node.key)
                parent = node.parent
                self._remove_subtree(node)
                self._offer_host(parent)
            # else a host-only node with children: offered again when its last child goes
        for entry in kept:
            heapq.heappush(heap, entry)

    def _drop_host_copy(self, node: TreeNode) -> int:
        assert node.host_value is not None
        self.host_pool.free(node.host_value)
        node.host_value = None
        self._host_nodes -= 1
        return len(node.key)

    def _remove_subtree(self, node: TreeNode) -> None:
        """Take `node` (off the device by now) and everything below it (host-only) out of
        the tree."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None and n.lock_ref == 0
            if n.host_value is not None:
                self._drop_host_copy(n)
            if self.events is not None:
                self.events.removed(n.blocks)
            self._dropped += len(n.key)
            stack.extend(n.children.values())
            n.parent = None  # detached: a stale handle to it is caught by _check_live
            self._num_nodes -= 1

    def _offer_host(self, node: TreeNode) -> None:
        if node is self._root or node.host_value is None:
            return
        heap = self._host_candidates
        heapq.heappush(heap, (node.last_access_time, node.node_id, node))
        if len(heap) > 2 * self._host_nodes + 64:
            heap[:] = [
                (n.last_access_time, n.node_id, n)
                for n in self._nodes()
                if n.host_value is not None
            ]
            heapq.heapify(heap)

    # -- sizes and checks --------------------------------------------------------
    def host_stats(self) -> HostCacheStats:
        return HostCacheStats(
            host_size_tokens=self.host_pool.size,
            host_used_tokens=self.host_pool.size - self.host_pool.available(),
            bytes_per_token=self._bytes_per_token,
            loaded_tokens=self._loaded,
            written_tokens=self._written,
            dropped_tokens=self._dropped,
            load_seconds=self._load_s,
            write_seconds=self._write_s,
            store_loaded_tokens=self._store_loaded,
            store_written_tokens=self._store_written,
            store_load_seconds=self._store_load_s,
            store_write_seconds=self._store_write_s,
        )

    def check_invariants(self) -> None:
        super().check_invariants()
        seen: set[int] = set()
        host_nodes = 0
        for node in self._nodes():
            if node.host_value is None:
                continue
            host_nodes += 1
            assert node.host_value.numel() == len(node.key), f"bad host slots in {node!r}"
            slots = node.host_value.tolist()
            assert seen.isdisjoint(slots) and len(set(slots)) == len(slots), "host slot twice"
            seen.update(slots)
        assert host_nodes == self._host_nodes, f"{self._host_nodes} host nodes, {host_nodes} found"
        assert 0 not in seen, "the host pool's reserved slot 0 is cached"
        assert seen.isdisjoint(self.host_pool.free_slot_ids()), "a host slot is cached and free"
        assert len(seen) + self.host_pool.available() == self.host_pool.size, (
            f"host pool: {len(seen)} cached + {self.host_pool.available()} free "
            f"!= {self.host_pool.size}"
        )
        standing = {id(n) for _, _, n in self._host_candidates}
        for node in self._nodes():
            if node.host_value is not None and (node.value is not None or not node.children):
                assert id(node) in standing, f"{node!r} is no host eviction candidate"
