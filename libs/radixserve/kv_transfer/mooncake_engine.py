"""KV rows from this worker's pool into a peer's, through Mooncake's TransferEngine.

Peers find each other by P2P handshake (no etcd): a session id is "host:rpc_port",
sent to the peer with the pool's layout. How long a call can block (measured with
0.3.13.post1 over TCP): against a peer process that has exited it fails at once
(connection refused or reset); against one that is alive but not answering, the data
phase gives up after MC_TRANSFER_TIMEOUT seconds (at least 5), set by `start`; the
first handshake with such a peer gives up after the binding's fixed ~60 s socket read
timeout, which no setting changes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixserve.kv_transfer.layout import KVPoolLayout
from radixserve.kv_transfer.runs import coalesce_runs

if TYPE_CHECKING:
    from radixserve.engine.kvcache.pool import KVPool

# The engine reads it when it is created; below 5 the TCP transport still waits 5 s.
_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
# Requests per batch call: with 0.3.13.post1 over TCP a batch of 2048 fails ("TCP lane
# queue-full rejection"), 1536 passes; larger writes go as several batches.
MAX_BATCH_REQUESTS = 1024


class KVTransferError(RuntimeError):
    """The engine refused or failed a call; `return_code` is what it returned."""

    def __init__(self, message: str, return_code: int) -> None:
        super().__init__(f"{message} (mooncake return code {return_code})")
        self.return_code = return_code


def _transfer_engine() -> Any:
    # Lazy: only a worker that moves KV needs the ~100 MB native package.
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(
            "KV transfer needs Mooncake's transfer engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU, TCP), mooncake-transfer-engine "
            "(CUDA 12) or mooncake-transfer-engine-cuda13; its native library also "
            f"needs libibverbs.so.1 (Debian: apt-get install libibverbs1). Import failed: {e}"
        ) from e
    return TransferEngine()


class MooncakeTransfer:
    """One transfer engine per worker: registers its pool, writes rows into peers' pools."""

    def __init__(self) -> None:
        self._engine: Any = None
        self._session_id = ""
        self._registered: list[int] = []

    def start(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", timeout_s: int = 30
    ) -> None:
        """Start the engine on `hostname` (its RPC port is picked free) with P2P handshake.

        `timeout_s` bounds a write to a peer that stops answering; it is process-wide
        (the engine takes it from the environment), so every engine here shares it."""
        if self._engine is not None:
            raise RuntimeError("transfer engine already started")
        os.environ[_TIMEOUT_ENV] = str(timeout_s)
        engine = _transfer_engine()
        rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise KVTransferError(f"cannot start the {protocol} transfer engine on {hostname}", rc)
        self._engine = engine
        self._session_id = f"{hostname}:{engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        """ "host:rpc_port": how peers name this engine."""
        self._require_started()
        return self._session_id

    def register_pool(self, pool: KVPool) -> KVPoolLayout:
        """Register every K and V buffer so peers may write into them; the pool's layout,
        to send to the peers that will."""
        self._require_started()
        layout = KVPoolLayout.of(pool, self._session_id)
        for addr in (*layout.k_addrs, *layout.v_addrs):
            rc = self._engine.register_memory(addr, layout.buffer_bytes)
            if rc != 0:
                raise KVTransferError(f"cannot register KV buffer at {addr:#x}", rc)
            self._registered.append(addr)
        return layout

    def write_slots(
        self,
        local: KVPoolLayout,
        src_slots: Sequence[int],
        remote: KVPoolLayout,
        dst_slots: Sequence[int],
    ) -> None:
        """Write every layer's K and V rows of `src_slots` (this engine's pool, `local`)
        into the rows `dst_slots` of the peer's pool `remote`: one request per run of slots
        consecutive on both sides, per buffer, sent in as few batches as the engine takes;
        returns when the bytes have landed, raises KVTransferError if they have not."""
        self._require_started()
        if local.session_id != self._session_id:
            raise ValueError(f"local layout belongs to {local.session_id}, not {self._session_id}")
        local.check_compatible(remote)
        _check_rows(src_slots, local)
        _check_rows(dst_slots, remote)
        runs = coalesce_runs(src_slots, dst_slots)
        if not runs:
            return
        row = local.bytes_per_slot
        src_addrs: list[int] = []
        dst_addrs: list[int] = []
        lengths: list[int] = []
        for src_bases, dst_bases in (
            (local.k_addrs, remote.k_addrs),
            (local.v_addrs, remote.v_addrs),
        ):
            for src_base, dst_base in zip(src_bases, dst_bases, strict=True):
                for run in runs:
                    src_addrs.append(src_base + run.src * row)
                    dst_addrs.append(dst_base + run.dst * row)
                    lengths.append(run.length * row)
        for start in range(0, len(lengths), MAX_BATCH_REQUESTS):
            end = start + MAX_BATCH_REQUESTS
            rc = self._engine.batch_transfer_sync_write(
                remote.session_id, src_addrs[start:end], dst_addrs[start:end], lengths[start:end]
            )
            if rc != 0:
                raise KVTransferError(
                    f"writing {len(src_slots)} KV slots ({len(lengths)} requests) "
                    f"to {remote.session_id} failed",
                    rc,
                )

    def close(self) -> None:
        """Deregister the pool's buffers; the engine itself stops when it is collected."""
        if self._engine is None:
            return
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered = []
        self._engine = None

    def _require_started(self) -> None:
        if self._engine is None:
            raise RuntimeError("transfer engine not started: call start() first")


def _check_rows(slots: Sequence[int], layout: KVPoolLayout) -> None:
    # An out-of-range slot would land in a neighbouring buffer, not fail.
    if slots and (min(slots) < 0 or max(slots) >= layout.num_rows):
        raise ValueError(
            f"KV slots outside {layout.session_id}'s pool of {layout.num_rows} rows: "
            f"{min(slots)}..{max(slots)}"
        )
