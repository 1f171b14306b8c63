"""FlashInfer's SM90 ("fa3") prefill kernels, for passes whose long prompts dominate.

On Hopper the SM90 kernels run a long query block's attention faster than FA2, but lose
on requests that add a few tokens (their 128-row query tiles run nearly empty), and the
kernel is persistent: it holds every SM until it ends, so a mixed batch's cascade
decoders on the side stream no longer run beside it. `use_sm90` weighs these (measured:
lab/notebook/2026-11-26-long-prompts-flashinfer-sm90-prefill-shared.md, lab/notebook/2026-12-01-figures-from-code-comments.md).

The kernels are JIT-compiled by FlashInfer the first time (minutes; cached after,
under FlashInfer's workspace). `Sm90Build`
compiles them in a background thread at start-up, at the lowest CPU priority, by
planning and running a small pass on its own stream and workspace; passes run FA2 until
the build is done. A failed build is logged once and leaves every pass on FA2. It is
opt-in (`enable_sm90_prefill`): while the build compiles, its nvcc processes slow the
engine's host thread (measured: lab/notebook/2026-11-26-suite-defaults-sm90-built-few-token.md),
and the compile takes several GB of host memory, which a container's limit may not leave.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

log = logging.getLogger(__name__)

# A request adding this many tokens or more is a long query block (SM90 runs it faster).
LONG_QUERY = 128
# A short request's key (one it reads for a token of a request adding fewer than
# LONG_QUERY) costs the SM90 kernel about what this many long query x key pairs save
# (H100, 8B shape: ~3.7 ns a key lost against ~17 ps a pair saved; rounded up).
SHORT_KEY_WEIGHT = 256
# Beside cascade decoders on the side stream, the long requests' pairs must be at least
# this many (a 2048-token chunk over ~4k keys) to pay for the lost overlap: the
# shared-prefix benchmark's question and prefix steps (~2-4.5M pairs) stay on FA2.
MIN_PAIRS_BESIDE_CASCADE = 8 * 2**20


def causal_pairs(new: int, kv: int) -> int:
    """Query x key pairs of one request adding `new` tokens to `kv - new` cached ones
    (causal within the new tokens)."""
    return new * (kv - new) + new * (new + 1) // 2


def use_sm90(q_lens: Sequence[int], kv_lens: Sequence[int], beside_cascade: bool) -> bool:
    """Whether a prefill pass over requests adding `q_lens` tokens to sequences of
    `kv_lens` runs faster on the SM90 kernels than on FA2 (`beside_cascade`: decoders
    run cascade on the side stream meanwhile)."""
    long_pairs = 0
    short_keys = 0
    for new, kv in zip(q_lens, kv_lens, strict=True):
        if new >= LONG_QUERY:
            long_pairs += causal_pairs(new, kv)
        else:
            short_keys += kv
    if long_pairs == 0 or long_pairs < SHORT_KEY_WEIGHT * short_keys:
        return False
    return not beside_cascade or long_pairs >= MIN_PAIRS_BESIDE_CASCADE


def is_sm90(device: torch.device) -> bool:
    """Hopper: the SM90 kernels' only target."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


class HeadLayout(NamedTuple):
    """What the SM90 kernels are compiled for."""

    device: torch.device
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


_builds: dict[HeadLayout, Sm90Build] = {}
_builds_lock = threading.Lock()


def sm90_build(flashinfer: Any, layout: HeadLayout) -> Sm90Build:
    """The process's build of the SM90 kernels for this layout, started on first ask:
    engines made one after another (tests, benchmarks) share it."""
    with _builds_lock:
        build = _builds.get(layout)
        if build is None:
            build = _builds[layout] = Sm90Build(
                functools.partial(run_small_pass, flashinfer, layout)
            )
    return build


class Sm90Build:
    """The SM90 prefill kernels of one head layout, compiled in a background thread
    (started here) by `compile`."""

    def __init__(self, compile: Callable[[], None]) -> None:
        self._done = threading.Event()
        self._ok = False
        threading.Thread(
            target=self._build,
            args=(compile,),
            name="radixserve-sm90-prefill-build",
            daemon=True,  # a build still running does not hold the process at exit
        ).start()

    @property
    def ready(self) -> bool:
        """Built and loaded: passes may run them."""
        return self._ok

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the build to end; whether the kernels are ready."""
        self._done.wait(timeout)
        return self._ok

    def _build(self, compile: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            # Lowest CPU priority for this thread and the nvcc processes it starts (they
            # inherit it): the engine's host thread keeps its cores meanwhile.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux, or not allowed: build as it is
            pass
        try:
            compile()
        except Exception:  # any failure leaves FA2 in charge; say why once
            log.warning(
                "FlashInfer's SM90 prefill kernels could not be built; prefills stay on FA2",
                exc_info=True,
            )
        else:
            self._ok = True
            log.info(
                "FlashInfer's SM90 prefill kernels ready in %.0f s: long prompts use them",
                time.perf_counter() - started,
            )
        finally:
            self._done.set()


def run_small_pass(flashinfer: Any, layout: HeadLayout) -> None:
    """Plan and run one small SM90 prefill (which compiles its kernels) on a stream and
    workspace of its own, so the engine's passes go on meanwhile."""
    device, num_heads, num_kv_heads, head_dim, dtype = layout
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        workspace = torch.zeros(32 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        tokens = 16
        indptr = torch.tensor([0, tokens], dtype=torch.int32)
        wrapper.plan(
            indptr,
            indptr,
            torch.arange(tokens, dtype=torch.int32, device=device),
            torch.ones(1, dtype=torch.int32),
            num_heads,
            num_kv_heads,
            head_dim,
            1,  # page size
            causal=True,
            sm_scale=head_dim**-0.5,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(tokens, 1, num_kv_heads, head_dim, dtype=dtype, device=device)
        wrapper.run(q, (kv, kv))
    stream.synchronize()
