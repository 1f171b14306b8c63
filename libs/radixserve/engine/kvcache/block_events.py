"""The radix cache's changes as KV events, in whole blocks (`protocol.kv_events`).

The cache reports what it stores and evicts here; the worker drains the log after each
step and publishes it, so the scheduler can keep a mirror of the tree and route a
prompt to the worker that holds its prefix. A block is `block_size` tokens (a whole
number of pages); a node's partial last block is not reported until a longer key
completes it. Each block is named by a hash chained over the prefix before it, so a
hash names the whole prefix up to its end (`protocol.kv_events.block_hashes`).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.protocol.kv_events import (
    AllBlocksCleared,
    KvEvent,
    OffloadedBlocks,
    RemovedBlocks,
    RestoredBlocks,
    StoredBlocks,
    block_hashes,
)
from radixserve.protocol.tokens import pack_tokens

# Blocks of at least this many tokens: fine enough to match a shared system prompt, coarse
# enough that hashing a 2048-token prompt costs 128 hashes, not 2048.
MIN_BLOCK_TOKENS = 16


def event_block_size(page_size: int) -> int:
    """The smallest whole number of pages that holds MIN_BLOCK_TOKENS tokens."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return page_size * -(-MIN_BLOCK_TOKENS // page_size)


class BlockEventLog:
    """Events since the last `drain`, in the order the cache changed."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._events: list[KvEvent] = []

    def stored(self, token_ids: Sequence[int], parent_hash: int | None) -> list[int]:
        """Record `token_ids` (whole blocks) cached after the block `parent_hash`
        (None: at the root); returns the blocks' hashes."""
        hashes = block_hashes(token_ids, self.block_size, parent_hash)
        if hashes:
            self._events.append(
                StoredBlocks(
                    block_hashes=hashes,
                    token_ids=pack_tokens(token_ids),
                    block_size=self.block_size,
                    parent_hash=parent_hash,
                )
            )
        return hashes

    def removed(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(RemovedBlocks(block_hashes=list(hashes)))

    def offloaded(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(OffloadedBlocks(block_hashes=list(hashes)))

    def restored(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(RestoredBlocks(block_hashes=list(hashes)))

    def cleared(self) -> None:
        """The whole cache is gone: what came before it no longer matters."""
        self._events = [AllBlocksCleared()]

    def drain(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
