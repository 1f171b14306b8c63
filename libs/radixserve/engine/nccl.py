"""NCCL's all-reduce and all-gather called directly (ctypes), on the caller's CUDA stream.

torch.distributed's `all_reduce` spends ~140 us of host time a call on an H100 host
(its work object, events, and stream waits around NCCL's own stream), which a short
prompt's eager prefill pays 64 times over an 8B model: it made that prefill host-bound
(docs/performance.md). Called directly, as SGLang's and vLLM's PyNccl wrappers do, an
all-reduce costs one `ncclAllReduce` launch on the current stream; CUDA graphs capture
it as they capture torch.distributed's. The library is the one torch loaded. The
vocabulary-parallel head gathers its logits the same way.
"""

from __future__ import annotations

import ctypes
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
    return lib


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
        with torch.cuda.device(device):
            self._check(self._lib.ncclCommInitRank(ctypes.byref(self._comm), size, uid, rank))

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
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self._check(
            self._lib.ncclAllReduce(
                x.data_ptr(),
                x.data_ptr(),
                x.numel(),
                NCCL_TYPES[x.dtype],
                NCCL_SUM,
                self._comm,
                stream,
            )
        )
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` into `out` (rank r's at `out`'s r-th x.numel() elements), on
        the current stream; `x` and `out` contiguous, of one dtype."""
        if out.numel() % x.numel() or out.dtype != x.dtype or not out.is_contiguous():
            raise NcclError("all_gather needs a contiguous out of the ranks' x, same dtype")
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self._check(
            self._lib.ncclAllGather(
                x.data_ptr(),
                out.data_ptr(),
                x.numel(),
                NCCL_TYPES[x.dtype],
                self._comm,
                stream,
            )
        )
        return out

    def close(self) -> None:
        if self._comm:
            self._lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()
