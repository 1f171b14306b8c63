"""The GEMM library's process-wide settings: cuBLASLt for torch's matmuls, and a
heuristics cache that holds every problem the engine's eager steps run.

cuBLASLt picks an algorithm for each GEMM problem (shapes, types, layouts) on the host
and caches the choice, 8192 problems by default. A miss costs several times a hit's host
time (measured: lab/probes/heuristics_cache.py, lab/notebook/2026-11-28-mixed-steps-attention-ways-cublaslt-heuristics.md). Decode
graphs and prefill pieces replay without asking; an eager step runs the model's
projections at its own row count, any of up to `chunked_prefill_size` + running rows.
Once the counts a server has met outnumber the cache's share (~2000), it cycles, and
each eager step misses on every projection.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from radixserve.engine.config import EngineConfig

log = logging.getLogger(__name__)

CAPACITY_ENV = "CUBLASLT_HEURISTICS_CACHE_CAPACITY"
# GEMM problems a row count brings: the fused qkv, o, gate_up and down projections and
# the head over the sampled rows, with room for one more.
PROBLEMS_PER_ROW_COUNT = 6
# ~1.5 KiB of host memory an entry (lab/probes/heuristics_cache.py): 96 MiB at most.
MAX_CAPACITY = 1 << 16


def prefer_cublaslt() -> None:
    """Route torch's GEMMs through cuBLASLt (process-wide), unless the process chose with
    TORCH_BLAS_PREFER_CUBLASLT: its kernels made a large decode step shorter and left
    batch 1 and prefill as they were (measured: lab/notebook/2026-12-01-figures-from-code-comments.md)."""
    if "TORCH_BLAS_PREFER_CUBLASLT" not in os.environ:
        torch.backends.cuda.preferred_blas_library("cublaslt")


def heuristics_cache_capacity(config: EngineConfig, max_running: int) -> int:
    """The cache capacity that holds the problems of every eager step's row count: a
    prefill chunk (or the whole prefill budget, unchunked) with every running request
    decoding beside it."""
    chunk = config.chunked_prefill_size
    prefill = min(chunk, config.max_prefill_tokens) if chunk > 0 else config.max_prefill_tokens
    return min(PROBLEMS_PER_ROW_COUNT * (prefill + max_running), MAX_CAPACITY)


def cublaslt_library() -> ctypes.CDLL | None:
    """The libcublasLt this process loaded (torch's), from the process's memory maps;
    None where it is not loaded (CPU torch, or no GEMM yet)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublasLt" in line})
    except OSError:
        return None
    return ctypes.CDLL(paths[0]) if paths else None


def heuristics_cache_size(lib: ctypes.CDLL) -> int | None:
    """The capacity of `lib`'s heuristics cache, in problems (None if it cannot say)."""
    current = ctypes.c_size_t()
    if lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(current)) != 0:
        return None
    return current.value


def size_heuristics_cache(capacity: int) -> int | None:
    """Raise cuBLASLt's heuristics cache to `capacity` problems (never lower it), unless
    the process set its own with CUBLASLT_HEURISTICS_CACHE_CAPACITY. Returns the
    capacity in force, or None where the library is not loaded or not asked."""
    if CAPACITY_ENV in os.environ:
        return None
    lib = cublaslt_library()
    if lib is None:
        log.debug("libcublasLt is not loaded: its heuristics cache is left as it is")
        return None
    current = heuristics_cache_size(lib)
    if current is None:
        log.warning("cublasLtHeuristicsCacheGetCapacity failed: the cache is left as it is")
        return None
    if current >= capacity:
        return current
    if lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(capacity)) != 0:
        log.warning("cublasLtHeuristicsCacheSetCapacity(%d) failed", capacity)
        return current
    log.info("cuBLASLt heuristics cache: %d -> %d problems", current, capacity)
    return capacity
