"""Moving KV cache rows between two workers' pools (prefill -> decode) through Mooncake.

`layout` describes a pool's buffers as plain data a peer can be sent; `runs` turns
slot lists into contiguous byte ranges; `mooncake_engine` moves them.
"""

from radixserve.kv_transfer.layout import KVLayoutMismatch, KVPoolLayout
from radixserve.kv_transfer.mooncake_engine import KVTransferError, MooncakeTransfer
from radixserve.kv_transfer.runs import SlotRun, coalesce_runs

__all__ = [
    "KVLayoutMismatch",
    "KVPoolLayout",
    "KVTransferError",
    "MooncakeTransfer",
    "SlotRun",
    "coalesce_runs",
]
