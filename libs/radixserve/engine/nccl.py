"""NCCL's all-reduce and all-gather called directly (ctypes), on the caller's CUDA stream.

torch.distributed's `all_reduce` spends host time a call (its work object, events, and
stream waits around NCCL's own stream), which a short prompt's eager prefill pays 64
times over an 8B model: it made that prefill host-bound (measured:
lab/notebook/2026-11-26-tensor-parallelism-two-h100s.md). Called directly, as SGLang's and vLLM's PyNccl wrappers do, an
all-reduce costs one `ncclAllReduce` launch on the current stream; CUDA graphs capture
it as they capture torch.distributed's. The library is the one torch loaded. The
vocabulary-parallel head gathers its logits the same way.

NCCL's kernels wait for every rank without a timeout: a communicator can be aborted
from another thread (`abort`, `abort_live_comms`), which ends such a wait.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

NCCL_SUM = 0
NCCL_TYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class NcclError(RuntimeError):
    pass


def _load() -> ctypes.CDLL:
    """libnccl as torch loaded it (a dlopen by soname finds the loaded copy)."""
    if not torch.cuda.is_available() or torch.cuda.nccl.version() is None:
        raise NcclError("this torch has no NCCL")
    torch.cuda.init()
    lib = ctypes.CDLL("libnccl.so.2")
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        _UniqueId,
        ctypes.c_int,
    ]
    lib.ncclAllReduce.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.ncclAllGather.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
    return lib


# Every communicator of this process not yet closed: what `abort_live_comms` ends.
_LIVE: weakref.WeakSet[NcclComm] = weakref.WeakSet()


def live_comms() -> bool:
    """Whether this process has a communicator open."""
    return len(_LIVE) > 0


def abort_live_comms(timeout_s: float) -> bool:
    """Abort every open communicator of this process (`NcclComm.abort`): False if one
    could not be."""
    return all([comm.abort(timeout_s) for comm in list(_LIVE)])


class NcclComm:
    """One rank's NCCL communicator over a tensor-parallel group's GPUs."""

    def __init__(self, rank: int, size: int, device: torch.device, broadcast: Any) -> None:
        """`broadcast(obj)`: rank 0's `obj` on every rank (a host collective), which
        carries rank 0's NCCL id to the others. Every rank calls this together."""
        self._lib = _load()
        uid = _UniqueId()
        if rank == 0:
            self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)))
        raw = broadcast(bytes(uid.internal) if rank == 0 else None)
        ctypes.memmove(uid.internal, raw, len(raw))
        self.device = device
        self._comm = ctypes.c_void_p()
        # Held while a call enqueues on the communicator, so `abort` (another thread)
        # never frees it under a call.
        self._lock = threading.Lock()
        with torch.cuda.device(device):
            self._check(self._lib.ncclCommInitRank(ctypes.byref(self._comm), size, uid, rank))
        _LIVE.add(self)

    def _check(self, result: int) -> None:
        if result != 0:
            message = self._lib.ncclGetErrorString(result).decode()
            raise NcclError(f"NCCL error {result}: {message}")

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.dtype in NCCL_TYPES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place, on the current stream (every rank gets the
        same bits)."""
        self._enqueue(
            self._lib.ncclAllReduce,
            x,
            x.data_ptr(),
            x.data_ptr(),
            x.numel(),
            NCCL_TYPES[x.dtype],
            NCCL_SUM,
        )
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` into `out` (rank r's at `out`'s r-th x.numel() elements), on
        the current stream; `x` and `out` contiguous, of one dtype."""
        if out.numel() % x.numel() or out.dtype != x.dtype or not out.is_contiguous():
            raise NcclError("all_gather needs a contiguous out of the ranks' x, same dtype")
        self._enqueue(
            self._lib.ncclAllGather, x, x.data_ptr(), out.data_ptr(), x.numel(), NCCL_TYPES[x.dtype]
        )
        return out

    def _enqueue(self, call: Callable[..., int], x: torch.Tensor, *args: Any) -> None:
        """`call(*args, comm, stream)` on `x`'s device's current stream."""
        stream = torch.cuda.current_stream(x.device).cuda_stream
        with self._lock:
            if not self._comm:
                raise NcclError("the NCCL communicator is closed (aborted: a rank was lost?)")
            self._check(call(*args, self._comm, stream))

    def abort(self, timeout_s: float) -> bool:
        """From another thread: end the communicator at once. Its kernels waiting on a
        rank that is gone return (their results are garbage), and every later call
        raises. False if a call held the communicator past `timeout_s` (its enqueue
        blocked: the device's launch queue full behind a kernel that cannot finish)."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            if self._comm:
                self._lib.ncclCommAbort(self._comm)
                self._comm = ctypes.c_void_p()
            _LIVE.discard(self)
        finally:
            self._lock.release()
        return True

    def close(self) -> None:
        with self._lock:
            if self._comm:
                self._lib.ncclCommDestroy(self._comm)
                self._comm = ctypes.c_void_p()
            _LIVE.discard(self)
