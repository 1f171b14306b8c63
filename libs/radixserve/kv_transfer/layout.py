"""Where a KV pool's rows live, as plain data a peer can be sent in a message.

Slot s of layer l is one contiguous row of `bytes_per_slot` bytes at
`k_addrs[l] + s * bytes_per_slot` (and likewise in V): a peer that knows this writes
rows straight into the pool's buffers, with no staging copy on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.kvcache.pool import KVPool


class KVLayoutMismatch(ValueError):
    """Two pools whose rows do not mean the same thing: copying bytes would corrupt KV."""


@dataclass(frozen=True)
class KVPoolLayout:
    session_id: str  # the transfer engine's "host:rpc_port" that owns the buffers
    k_addrs: tuple[int, ...]  # base address of each layer's K buffer
    v_addrs: tuple[int, ...]
    bytes_per_slot: int
    num_rows: int  # rows in each buffer: the pool's slots plus its reserved first page
    page_size: int
    num_layers: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if len(self.k_addrs) != self.num_layers or len(self.v_addrs) != self.num_layers:
            raise ValueError(
                f"{len(self.k_addrs)} K and {len(self.v_addrs)} V buffers "
                f"for {self.num_layers} layers"
            )

    @classmethod
    def of(cls, pool: KVPool, session_id: str) -> KVPoolLayout:
        buffers = [*pool.k_buffers, *pool.v_buffers]
        if not all(b.is_contiguous() for b in buffers):
            raise ValueError("KV buffers must be contiguous to be addressed by slot")
        first = pool.k_buffers[0]
        return cls(
            session_id=session_id,
            k_addrs=tuple(b.data_ptr() for b in pool.k_buffers),
            v_addrs=tuple(b.data_ptr() for b in pool.v_buffers),
            bytes_per_slot=first[0].numel() * first.element_size(),
            num_rows=first.shape[0],
            page_size=pool.page_size,
            num_layers=pool.num_layers,
            dtype=str(pool.dtype).removeprefix("torch."),
        )

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one layer's K (or V) buffer: what gets registered with the engine."""
        return self.num_rows * self.bytes_per_slot

    def check_compatible(self, other: KVPoolLayout) -> None:
        """Raise KVLayoutMismatch unless a row of `other` holds what a row of this holds.

        Page sizes may differ: rows are copied slot by slot."""
        mine = (self.num_layers, self.bytes_per_slot, self.dtype)
        theirs = (other.num_layers, other.bytes_per_slot, other.dtype)
        if mine != theirs:
            raise KVLayoutMismatch(
                f"KV pools differ (layers, bytes per slot, dtype): {self.session_id} has "
                f"{mine}, {other.session_id} has {theirs}"
            )
