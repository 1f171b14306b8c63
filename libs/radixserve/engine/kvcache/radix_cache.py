"""RadixAttention's prefix cache: a radix tree from token sequences to KV slots.

Each edge holds a run of tokens (`key`) and the KV slots of those tokens (`value`).
A running request locks the path from the root to its matched node (`lock_ref`), so
eviction only ever takes unlocked leaves, least recently used first. Candidates wait in
a heap kept as the tree changes: each time a node may become an unlocked leaf or its
access time moves, it is pushed again, and entries that no longer hold (the node was
evicted, locked, given a child or touched since) are dropped when they surface. An
eviction costs O(log n) a leaf, not a walk over the whole tree (measured:
lab/notebook/2026-11-27-radix-eviction-lru-heap-kept-changes.md).

With page_size > 1 the tree works in whole pages: children are keyed by their first
page, matches are whole pages, and inserted keys must be page-aligned (the caller
keeps the slots of a trailing partial page, as SGLang's scheduler does).

With a `BlockEventLog` (`enable_events`), every change is also recorded as KV events in
blocks of `log.block_size` tokens: a node keeps the hashes of the blocks that end inside
it (`blocks`), stores them when it is created, hands them to the upper part when it is
split, and removes them when it is evicted. `snapshot_events` describes the whole tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixserve.engine.kvcache.base import CacheSizes, MatchResult, PrefixCache
from radixserve.engine.kvcache.block_events import BlockEventLog
from radixserve.engine.kvcache.pool import KVPool
from radixserve.protocol.kv_events import AllBlocksCleared, KvEvent, StoredBlocks
from radixserve.protocol.tokens import pack_tokens

ChildKey = int | tuple[int, ...]


class TreeNode:
    __slots__ = (
        "blocks",
        "children",
        "depth",
        "host_value",
        "key",
        "last_access_time",
        "lock_ref",
        "node_id",
        "parent",
        "value",
    )

    def __init__(
        self, node_id: int, key: list[int], value: torch.Tensor | None, parent: TreeNode | None
    ) -> None:
        self.node_id = node_id  # tie-break for the eviction heap; stable across splits
        self.key = key
        # int64 KV slots, one per token of `key`; None only in a HiRadixCache, for a node
        # whose KV lives in host memory alone (`host_value`: its slots in the host pool).
        self.value = value
        self.host_value: torch.Tensor | None = None
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)  # root..end
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = 0
        self.blocks: list[int] = []  # KV-event hashes of the blocks ending in this node

    def __repr__(self) -> str:
        head = " ".join(map(str, self.key[:8])) + (" …" if len(self.key) > 8 else "")
        return (
            f"TreeNode([{head}] len={len(self.key)} lock={self.lock_ref} t={self.last_access_time})"
        )


# Lists compared a block at a time (in C) before the token-by-token scan of the block
# that differs: a 2048-token system prompt is ~30 block compares, not 2048 in Python.
_COMPARE_BLOCK = 64


def common_prefix_len(a: list[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    b = b if isinstance(b, list) else list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i + _COMPARE_BLOCK <= n and a[i : i + _COMPARE_BLOCK] == b[i : i + _COMPARE_BLOCK]:
        i += _COMPARE_BLOCK
    while a[i] == b[i]:  # stops inside this block: a token differs before n
        i += 1
    return i


class RadixCache(PrefixCache):
    def __init__(self, kv_pool: KVPool, page_size: int | None = None) -> None:
        # Default: the pool's page size (the two must agree).
        page_size = kv_pool.page_size if page_size is None else page_size
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if kv_pool.page_size != page_size:
            raise ValueError(
                f"RadixCache page_size {page_size} differs from the KV pool's {kv_pool.page_size}"
            )
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.events: BlockEventLog | None = None
        self._clock = itertools.count(1)  # logical LRU time: deterministic, strictly increasing
        self._node_ids = itertools.count()
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = TreeNode(next(self._node_ids), [], self._empty(), None)
        self._root_locks = 0  # locks on the empty match: they protect nothing
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._num_nodes = 0  # below the root
        # (last_access_time, node_id, node) of every unlocked leaf, among stale entries.
        self._candidates: list[tuple[int, int, TreeNode]] = []

    def reset(self) -> None:
        if self._protected_tokens or self._root_locks:
            raise RuntimeError("RadixCache.reset() while requests still hold locks on it")
        self._init_tree()
        if self.events is not None:
            self.events.cleared()

    # -- KV events -----------------------------------------------------------------
    def enable_events(self, log: BlockEventLog) -> None:
        """Record every change in `log` from now on (an empty cache only: what is cached
        already would be missing from the events)."""
        if self._root.children:
            raise RuntimeError("enable_events on a cache that already holds prefixes")
        if log.block_size % self.page_size:
            raise ValueError(
                f"event block size {log.block_size} is not a whole number of pages "
                f"({self.page_size} tokens)"
            )
        self.events = log

    def _last_block_hash(self, node: TreeNode) -> int | None:
        """The hash of the last whole block ending at or above `node`'s end."""
        walk: TreeNode | None = node
        while walk is not None and not walk.blocks:
            walk = walk.parent
        return walk.blocks[-1] if walk is not None else None

    def _record_stored(self, leaf: TreeNode, key: Sequence[int]) -> None:
        """Store the blocks that end inside the new `leaf` (`key`: root..leaf's end)."""
        assert self.events is not None and leaf.parent is not None
        size = self.events.block_size
        first, end = leaf.parent.depth // size * size, leaf.depth // size * size
        if end > first:
            parent_hash = self._last_block_hash(leaf.parent)
            leaf.blocks = self.events.stored(list(key[first:end]), parent_hash)

    def snapshot_events(self) -> list[KvEvent]:
        """The whole tree as events: cleared, then every node's blocks, parents first."""
        events: list[KvEvent] = [AllBlocksCleared()]
        size = self.events.block_size if self.events is not None else 0
        if not size:
            return events
        stack: list[tuple[TreeNode, list[int], int | None]] = [
            (child, [], None) for child in self._root.children.values()
        ]
        while stack:
            node, above, parent_hash = stack.pop()
            path = above + node.key
            if node.blocks:
                end = node.depth // size * size
                first = end - size * len(node.blocks)
                events.append(
                    StoredBlocks(
                        block_hashes=list(node.blocks),
                        token_ids=pack_tokens(path[first:end]),
                        block_size=size,
                        parent_hash=parent_hash,
                    )
                )
            last = node.blocks[-1] if node.blocks else parent_hash
            stack.extend((child, path, last) for child in node.children.values())
        return events

    # -- lookup and insertion ----------------------------------------------------
    def match_prefix(self, key: Sequence[int], load: bool = False) -> MatchResult:
        key = key[: len(key) // self.page_size * self.page_size]
        node, _, path = self._walk(key)
        return MatchResult(indices=self._slots_of(path), node=node)

    def _slots_of(self, path: list[TreeNode]) -> torch.Tensor:
        """The device slots of `path`'s nodes, in token order (all of them on the device)."""
        values = [n.value for n in path if n.value is not None]
        return torch.cat(values) if values else self._empty()

    def _walk(self, key: Sequence[int]) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow `key` down the tree, splitting the last node where the match ends inside
        it and touching every node passed (LRU). Returns the deepest node, how many tokens
        matched, and the matched nodes below the root."""
        now = next(self._clock)
        node = self._root
        node.last_access_time = now
        path: list[TreeNode] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            path.append(child)
            node = child
            pos += n
        self._offer(node)  # touched: an unlocked leaf's older entry no longer holds
        return node, pos, path

    def path(self, node: Any) -> list[tuple[int, int]]:
        nodes: list[TreeNode] = []
        while node is not None and node is not self._root:
            nodes.append(node)
            node = node.parent
        out: list[tuple[int, int]] = []
        length = 0
        for n in reversed(nodes):
            length += len(n.key)
            out.append((n.node_id, length))
        return out

    def insert(self, key: Sequence[int], indices: torch.Tensor) -> int:
        self._check_insert_args(key, indices)
        node, pos, _ = self._walk(key)
        if pos < len(key):
            self._add_leaf(node, key, pos, indices)
        return pos

    def _add_leaf(
        self, node: TreeNode, key: Sequence[int], pos: int, indices: torch.Tensor
    ) -> TreeNode:
        """A new leaf under `node` (which matched key[:pos]) for key[pos:] and its slots."""
        # clone: a view would keep the caller's whole index tensor alive
        leaf = TreeNode(next(self._node_ids), list(key[pos:]), indices[pos:].clone(), node)
        leaf.last_access_time = node.last_access_time  # this walk's clock tick
        node.children[self._child_key(leaf.key, 0)] = leaf
        self._num_nodes += 1
        self._offer(leaf)
        self._evictable_tokens += len(leaf.key)
        if self.events is not None:
            self._record_stored(leaf, key)
        return leaf

    def _check_insert_args(self, key: Sequence[int], indices: torch.Tensor) -> None:
        if indices.dim() != 1 or indices.dtype != torch.int64:
            raise ValueError(
                f"indices must be a 1-D int64 tensor, got {indices.dtype} of shape {tuple(indices.shape)}"
            )
        if indices.numel() != len(key):
            raise ValueError(f"key has {len(key)} tokens but indices has {indices.numel()} slots")
        if len(key) % self.page_size:
            raise ValueError(
                f"insert needs whole pages: key length {len(key)} is not a multiple of "
                f"page_size {self.page_size}; keep the partial last page out of the cache"
            )

    def _child_key(self, key: Sequence[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _match_len(self, node_key: list[int], key: Sequence[int], pos: int) -> int:
        """Tokens (whole pages) that node_key shares with key[pos:]."""
        n = common_prefix_len(node_key, key[pos : pos + len(node_key)])
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; return the new upper node. The child object keeps the
        lower part, so handles to it (held by running requests) stay valid."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        value = child.value
        upper = TreeNode(
            next(self._node_ids), child.key[:n], None if value is None else value[:n], parent
        )
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.lock_ref = child.lock_ref  # same locks cover both parts: counters are unchanged
        upper.last_access_time = child.last_access_time
        if child.blocks:  # the blocks ending in the upper part move with it
            size = self.events.block_size if self.events is not None else 1
            moved = upper.depth // size - parent.depth // size
            upper.blocks, child.blocks = child.blocks[:moved], child.blocks[moved:]
        parent.children[self._child_key(upper.key, 0)] = upper
        self._num_nodes += 1
        child.key = child.key[n:]
        child.value = None if value is None else value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    # -- locking -----------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> None:
        self._check_live(node)
        if node is self._root:
            self._root_locks += 1
            return
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        self._check_live(node)
        if node is self._root:
            if self._root_locks == 0:
                raise RuntimeError("dec_lock_ref on the root without a matching inc_lock_ref")
            self._root_locks -= 1
            return
        # NOTE: ancestors' lock_ref >= node's, so checking the node itself is enough.
        if node.lock_ref == 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
        start = node
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_tokens -= len(node.key)
                self._evictable_tokens += len(node.key)
            node = node.parent
        self._offer(start)  # its ancestors have children: only it may be a leaf

    def _check_live(self, node: Any) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a RadixCache handle from match_prefix, got {type(node)}")
        walk: TreeNode | None = node
        while walk is not None and walk is not self._root:
            walk = walk.parent
        if walk is None:
            raise RuntimeError(
                "stale RadixCache handle: its node was evicted or the cache was reset; match again"
            )

    # -- eviction ----------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        heap = self._candidates
        freed = 0
        while freed < num_tokens and heap:
            touched, _, leaf = heapq.heappop(heap)
            if not self._holds(touched, leaf):
                continue
            parent = leaf.parent
            assert parent is not None and leaf.value is not None
            self.kv_pool.free(leaf.value)
            del parent.children[self._child_key(leaf.key, 0)]
            if self.events is not None:
                self.events.removed(leaf.blocks)
            leaf.parent = None  # detached: a stale handle to it is caught by _check_live
            self._num_nodes -= 1
            self._evictable_tokens -= len(leaf.key)
            freed += len(leaf.key)
            self._offer(parent)
        return freed

    def _evictable(self, node: TreeNode) -> bool:
        return node is not self._root and not node.children and node.lock_ref == 0

    def _holds(self, touched: int, node: TreeNode) -> bool:
        """Whether a candidate entry still stands: the node is in the tree, an unlocked
        leaf, and untouched since the entry was made."""
        return (
            node.parent is not None and self._evictable(node) and node.last_access_time == touched
        )

    def _offer(self, node: TreeNode) -> None:
        """Push `node` as a candidate if it is an unlocked leaf now; rebuild the heap from
        the tree once stale entries outnumber the nodes (amortised O(1) a push)."""
        if not self._evictable(node):
            return
        heap = self._candidates
        heapq.heappush(heap, (node.last_access_time, node.node_id, node))
        if len(heap) > 2 * self._num_nodes + 64:
            heap[:] = [
                (n.last_access_time, n.node_id, n) for n in self._nodes() if self._evictable(n)
            ]
            heapq.heapify(heap)

    # -- sizes and checks --------------------------------------------------------
    def sizes(self) -> CacheSizes:
        return CacheSizes(
            evictable_tokens=self._evictable_tokens, protected_tokens=self._protected_tokens
        )

    def total_size(self) -> int:
        return self._evictable_tokens + self._protected_tokens

    def cached_slots(self) -> torch.Tensor:
        return self._slots_of(list(self._nodes()))

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        root = self._root
        assert root.parent is None and not root.key and root.value is not None
        assert root.value.numel() == 0 and root.lock_ref == 0 and self._root_locks >= 0
        evictable = protected = num_nodes = 0
        seen: set[int] = set()
        standing = {id(n) for t, _, n in self._candidates if self._holds(t, n)}
        for node in self._nodes():
            num_nodes += 1
            if self._evictable(node):
                assert id(node) in standing, f"unlocked leaf {node!r} is no eviction candidate"
            parent = node.parent
            assert parent is not None, f"{node!r} in the tree has no parent"
            assert node.key and len(node.key) % self.page_size == 0, f"{node!r} is not whole pages"
            assert parent.children.get(self._child_key(node.key, 0)) is node, f"{node!r} misfiled"
            assert node.lock_ref >= 0, f"negative lock_ref in {node!r}"
            assert node.depth == parent.depth + len(node.key), f"{node!r} has a wrong depth"
            size = self.events.block_size if self.events is not None else 0
            ends = node.depth // size - parent.depth // size if size else 0
            assert len(node.blocks) == ends, f"{node!r} holds {len(node.blocks)} of {ends} blocks"
            child_locks = sum(c.lock_ref for c in node.children.values())
            # Each lock on a descendant also counts on this node.
            assert node.lock_ref >= child_locks, f"{node!r} has fewer locks than its children"
            assert parent.last_access_time >= node.last_access_time, f"{node!r} newer than parent"
            if node.value is None:  # host memory alone (HiRadixCache): the checks there
                assert node.host_value is not None and node.lock_ref == 0, f"{node!r} holds no KV"
                continue
            # What is on the device is a subtree from the root: a match's slots are one run.
            assert parent.value is not None, f"{node!r} is on the device, its parent is not"
            assert len(node.key) == node.value.numel(), f"bad key/value in {node!r}"
            assert node.value.dtype == torch.int64 and node.value.device == self.kv_pool.device
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            slots = node.value.tolist()
            assert seen.isdisjoint(slots) and len(set(slots)) == len(slots), "slot cached twice"
            seen.update(slots)
        assert evictable == self._evictable_tokens, (
            f"evictable {self._evictable_tokens} != {evictable}"
        )
        assert protected == self._protected_tokens, (
            f"protected {self._protected_tokens} != {protected}"
        )
        assert 0 not in seen, "the reserved padding slot 0 is cached"
        assert num_nodes == self._num_nodes, f"{self._num_nodes} nodes counted, {num_nodes} found"
        assert seen.isdisjoint(self.kv_pool.free_slot_ids()), (
            "a cached slot is also on the free list"
        )

    def pretty(self) -> str:
        """The tree, one node per line, indented by depth (for debugging)."""
        lines = [repr(self)]
        stack = [(c, 1) for c in self._root.children.values()]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + repr(node))
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"RadixCache(nodes={sum(1 for _ in self._nodes())}, evictable={self._evictable_tokens}, "
            f"protected={self._protected_tokens}, page_size={self.page_size})"
        )

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.kv_pool.device)
