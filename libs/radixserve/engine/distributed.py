"""Tensor parallelism's process group: which rank this process is, and its collectives.

A tensor-parallel engine runs one process per rank (rank 0 is the engine the caller
made; `engine/tensor_parallel.py` runs the others), each with a shard of every
projection and of the KV heads (model/llama.py). The model's row-parallel projections
and its vocabulary-parallel embeddings sum their partial outputs with `all_reduce`
(NCCL on CUDA, gloo on the CPU); the head's vocabulary shards meet with `all_gather`.
Host objects (the NCCL id, the KV budget at start-up) go through a gloo group
(`broadcast_object`, `min_int`); each step's scheduler inputs go down a pipe to each rank
(`engine/tensor_parallel.py`), so every rank schedules the same batches.
On CUDA the model's eager collectives call NCCL directly on the compute stream
(`engine/nccl.py`: torch.distributed's cost host time each); those captured in
CUDA graphs go through torch.distributed, whose graphs replay faster.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from radixserve.engine.nccl import NcclComm, NcclError, abort_live_comms, live_comms

log = logging.getLogger(__name__)
TEARDOWN_TIMEOUT_S = 30.0
JOINED_KEY = "radixserve/joined"  # rank r sets JOINED_KEY/r in the store as it joins


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Any = None  # the device collectives' group (None: one rank, nothing to do)
    cpu_group: Any = None  # gloo, for broadcast_object
    nccl: NcclComm | None = None  # the model's all-reduces, called directly (CUDA)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows): it must divide evenly."""
        if total % self.size:
            raise ValueError(
                f"tp_size {self.size} does not divide the model's {total} {what}; "
                "choose a tp_size that does"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same bits)."""
        if self.size == 1:
            return x
        comm = self._direct(x)
        if comm is not None:
            return comm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def _direct(self, x: torch.Tensor) -> NcclComm | None:
        """The communicator a collective on `x` calls NCCL through directly: eagerly,
        where it saves torch.distributed's host time; None (torch.distributed) while a
        CUDA graph is captured, whose replays measured faster so (measured:
        lab/notebook/2026-11-26-tensor-parallelism-vocabulary-parallel-head-torch.md)."""
        if self.nccl is None or not self.nccl.supports(x):
            return None
        return None if torch.cuda.is_current_stream_capturing() else self.nccl

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on each), stacked: [size, *x.shape]."""
        if self.size == 1:
            return x.unsqueeze(0)
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        comm = self._direct(x)
        if comm is not None:
            return comm.all_gather(x, out)
        # One flat output (torch >= 2.13 renames the call; 2.11 has the old name only).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1, *x.shape[1:]), x, group=self.group)
        return out

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (host collective)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(box.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others pass anything, e.g. None)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


SINGLE = TPGroup(rank=0, size=1)


def free_tcp_address() -> str:
    """A rendezvous address for the ranks of one engine (a free local port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def init_tp_group(
    rank: int,
    size: int,
    address: str,
    device: torch.device,
    timeout_s: float,
    lost: Callable[[], str | None] | None = None,
) -> TPGroup:
    """Join the engine's process group (every rank calls this with the same `address`, a
    `free_tcp_address`). `timeout_s` (`dist_timeout_s`): a collective that waits this long
    fails. Rank 0 hosts the rendezvous and waits there for the others to check in,
    asking `lost()` (which rank has exited, if one has) as it waits: a rank that dies
    before it joins is an error at once, not a wait of `timeout_s`."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = _rendezvous(rank, size, address, timeout_s, lost)
    dist.init_process_group(backend, store=store, world_size=size, rank=rank, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, dist.group.WORLD, cpu_group if backend == "nccl" else None)


def _rendezvous(
    rank: int,
    size: int,
    address: str,
    timeout_s: float,
    lost: Callable[[], str | None] | None,
    poll_s: float = 0.05,
) -> dist.TCPStore:
    """The group's store at `address` (tcp://host:port): rank 0 serves it and returns once
    every other rank has checked in; the others connect and check in."""
    url = urlsplit(address)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"a rendezvous address is tcp://host:port, not {address!r}")
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        store = dist.TCPStore(url.hostname, url.port, size, is_master=False, timeout=timeout)
        store.set(f"{JOINED_KEY}/{rank}", "1")
        return store
    store = dist.TCPStore(
        url.hostname, url.port, size, is_master=True, timeout=timeout, wait_for_workers=False
    )
    keys = [f"{JOINED_KEY}/{r}" for r in range(1, size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        gone = lost() if lost is not None else None
        if gone is not None:
            raise RuntimeError(f"before joining the tensor-parallel group, {gone}")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise RuntimeError(
                f"tensor-parallel ranks {', '.join(missing)} did not join the group within "
                f"{timeout_s:.0f} s (dist_timeout_s)"
            )
        time.sleep(poll_s)
    return store


def with_direct_nccl(tp: TPGroup, device: torch.device) -> TPGroup:
    """`tp` with its all-reduces on NCCL called directly (CUDA; `engine/nccl.py`), once
    a probe agrees with torch.distributed's on every rank; else `tp` as it is, with a
    warning that says why. Every rank calls this, in the same order."""
    if tp.size == 1 or device.type != "cuda":
        return tp
    comm: NcclComm | None = None
    try:
        comm = NcclComm(tp.rank, tp.size, device, tp.broadcast_object)
        # Small integers: every sum exact, whatever order either adds in.
        probe = (torch.arange(4096, device=device) % 8 * (tp.rank + 1)).to(torch.bfloat16)
        expected = probe.clone()
        dist.all_reduce(expected, group=tp.group)
        agrees = torch.equal(comm.all_reduce(probe), expected)
        if not agrees:
            log.warning("NCCL called directly disagrees with torch.distributed: not used")
    except (NcclError, OSError, AttributeError) as exc:
        log.warning("NCCL cannot be called directly (%s): torch.distributed's all-reduce", exc)
        agrees = False
    if tp.min_int(int(agrees)) == 0:  # every rank on the same path
        if comm is not None:
            comm.close()
        return tp
    return dataclasses.replace(tp, nccl=comm)


def tp_group_active() -> bool:
    """Whether this process is in a tensor-parallel group already (one per process: the
    group is torch.distributed's default one)."""
    return dist.is_available() and dist.is_initialized()


# Set once this process has aborted NCCL collectives (`abort_device_collectives`).
_ABORTED = threading.Event()


def check_tp_group_free() -> None:
    """Raise ValueError where this process cannot start a tensor-parallel group."""
    if tp_group_active():
        raise ValueError(
            "a tensor-parallel engine is already running in this process: shut it down "
            "before starting another (one per process)"
        )
    if _ABORTED.is_set():
        raise ValueError(
            "this process lost a tensor-parallel rank and aborted its NCCL collectives; "
            "NCCL is not started here again: start a new process"
        )


def abort_device_collectives(timeout_s: float = 5.0) -> None:
    """End this process's NCCL collectives at once, from any thread: kernels that wait
    for a rank whose process is gone return (with garbage), and later collectives
    raise. NCCL has no timeout of its own there (torch.distributed's watchdog only after
    `dist_timeout_s`), so rank 0 calls this as soon as it sees a rank's process gone
    (`tensor_parallel.RankWatch`). The group is unusable afterwards, and the process
    starts no other (`check_tp_group_free`)."""
    torch_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if not torch_nccl and not live_comms():
        return  # gloo (CPU): its collectives fail by themselves when a peer goes
    _ABORTED.set()
    # torch's communicators and the direct ones at once: tearing one down can wait for
    # the device, which a kernel of the other keeps busy until its own abort.
    aborting = threading.Thread(target=_abort_torch_group, daemon=True, name="tp-abort")
    if torch_nccl:
        aborting.start()
    if not abort_live_comms(timeout_s):
        log.warning("a direct NCCL communicator stayed busy for %.0f s: not aborted", timeout_s)
    if torch_nccl:
        aborting.join(timeout_s)
        if aborting.is_alive():
            log.warning("torch.distributed's group still aborting after %.0f s", timeout_s)


def _abort_torch_group() -> None:
    try:
        distributed_c10d._abort_process_group()
    except Exception:  # it may be going already
        log.exception("aborting torch.distributed's process group failed")


def destroy_tp_group(tp: TPGroup, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Close the group's communicators, waiting at most `timeout_s`: a collective that
    cannot finish (a rank lost in the middle of one) can hold NCCL's teardown forever,
    and a shutdown must end. Past the timeout the teardown is left running in a daemon
    thread, logged, and this process cannot start another tensor-parallel engine."""

    failure: list[BaseException] = []

    def run() -> None:
        try:
            if tp.nccl is not None:
                tp.nccl.close()
            if tp.size > 1 and dist.is_initialized():
                dist.destroy_process_group()
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=run, name="tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning(
            "the tensor-parallel group did not shut down within %.0f s (a collective that "
            "cannot finish: a rank lost in the middle of one?); left behind",
            timeout_s,
        )
    elif failure:
        raise failure[0]
