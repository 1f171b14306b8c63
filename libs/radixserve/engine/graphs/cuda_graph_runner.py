"""Decode passes captured as CUDA graphs at start-up and replayed every decode step.

Why: a decode pass of a 32-layer model is some 1,200 small kernels, each launched
from Python; at small batch sizes the host takes longer to launch them than the GPU
to run them. A replay launches the whole captured pass in one call.

How (SGLang's CudaGraphRunner, smaller):

- One graph per size of a ladder (`capture_batch_sizes`); a decode batch runs on the
  smallest graph that holds it, the rows past its size being padding.
- Static inputs: one [5, max_bs] int64 buffer (token ids, positions, KV slots of the
  new tokens, request rows, KV lengths) that every graph reads a prefix of; a replay
  copies the batch into it, in one copy when the batch builder uploaded the batch's
  inputs as one tensor in the same row order (`ForwardBatch.decode_inputs`).
  Padding rows hold token 0 at position 0, write their KV to the reserved slot 0,
  and point at the request pool's padding row (all zeros, so slot 0 again) with
  length 1: they read and write nothing but slot 0, and their logits are dropped.
- The attention backend keeps its metadata in its own fixed buffers
  (AttentionBackend.init_cuda_graph_state and the capture/replay methods).
- Graphs are captured largest first into one memory pool, so the smaller ones reuse
  the larger ones' memory.
- With `cascade`, sizes from CASCADE_MIN_BS up get a second graph: the cascade
  (shared-prefix) variant of the pass, replayed for decode batches that carry
  `shared_prefixes`, whose groups the backend writes into its fixed tables before the
  replay (attention/cascade.py).
- Sampling runs outside the graph, on the logits a replay returns: a view of the one
  [max_bs, vocab] output buffer (model dtype) every graph writes its logits into (a
  float32 buffer per graph held the sum of the ladder's sizes: 17 GB for an 8B model's
  vocabulary up to 1024), valid until the next forward pass (the scheduler samples
  before it runs another).

With `capture=False` the runner replays by running the same padded static pass
eagerly: the CPU tests check padding and the capture-time metadata that way, where
there is no CUDA to capture with.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixserve.engine.forward_batch import DECODE_INPUT_FIELDS, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.engine.attention.base import AttentionBackend
    from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool

log = logging.getLogger(__name__)

Model = Callable[[ForwardBatch, "AttentionBackend", torch.Tensor | None], torch.Tensor]

# Rows of the static input buffer: a decode batch's `decode_inputs` rows, in one copy.
_IDS, _POS, _LOC, _ROWS, _LENS = (
    DECODE_INPUT_FIELDS.index(name)
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
)
_NUM_INPUTS = len(DECODE_INPUT_FIELDS)
# Warm-up passes before each capture: they compile the kernels and size the scratch
# buffers outside the capture (a capture may not allocate outside its pool).
_WARMUP_PASSES = 2
# Smallest graph with a cascade variant: below it few requests can share a prefix, and
# each variant costs capture time and memory.
CASCADE_MIN_BS = 8


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16, up to and including `max_bs`."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    ladder = {1, 2, 4, 8, 16, 24, 32, *range(48, max_bs + 1, 16)}
    return sorted({bs for bs in ladder if bs <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(
        self,
        model: Model,
        attn: AttentionBackend,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        max_bs: int,
        capture: bool = True,
        cascade: bool = False,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`stream`: the capture stream (a new one if None)."""
        if not attn.supports_cuda_graph:
            raise ValueError(f"the {attn.name} attention backend cannot be captured in graphs")
        if cascade and not attn.supports_shared_prefix:
            raise ValueError(f"the {attn.name} attention backend has no cascade attention")
        if capture and kv_pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.attn = attn
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.captured = capture
        self.num_replays = 0  # tests and benchmarks check the graphs ran
        device = kv_pool.device
        with torch.inference_mode():
            padding = torch.zeros((_NUM_INPUTS, self.max_bs), dtype=torch.int64, device=device)
            padding[_ROWS] = req_pool.padding_row
            padding[_LENS] = 1
            self._padding = padding
            self._inputs = padding.clone()
            self._ones = torch.ones(self.max_bs, dtype=torch.int64, device=device)
            self._arange = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self._ones_cpu, self._zeros_cpu = [1] * self.max_bs, [0] * self.max_bs
        attn.init_cuda_graph_state(self.max_bs, req_pool.max_context_len)
        self._batches = {bs: self._static_batch(bs) for bs in self.batch_sizes}
        self.cascade_sizes = [bs for bs in self.batch_sizes if cascade and bs >= CASCADE_MIN_BS]
        # The cascade variants run on batches of their own: a replay sets their groups.
        self._cascade_batches = {bs: self._static_batch(bs) for bs in self.cascade_sizes}
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_bs, vocab], at the first pass
        self.capture_stream = stream  # lab/probes/graph_gaps.py reads it
        if capture:
            try:
                self._capture_all()
            except torch.OutOfMemoryError as exc:
                raise RuntimeError(
                    f"out of GPU memory capturing decode graphs of up to {self.max_bs} "
                    "requests: lower cuda_graph_max_bs or mem_fraction_static, or disable "
                    "CUDA graphs"
                ) from exc
        elif self.cascade_sizes:
            # What capture would have taught the backend (its cascade tile layout).
            with torch.inference_mode():
                self._run(self._cascade_batches[self.cascade_sizes[-1]], cascade=True)

    # -- replay -------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the captured graphs now, whoever still holds this runner: a graph
        holding a collective keeps its communicator busy, and tearing the tensor-parallel
        group down then waits for it forever. Nothing runs on the graphs afterwards."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._batches.clear()
        self._cascade_batches.clear()
        self.max_bs = 0  # can_run: nothing from now on

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of up to max_bs requests; cascade (shared-prefix) ones where
        their size has a cascade variant."""
        if batch.mode != ForwardMode.DECODE or not 0 < batch.batch_size <= self.max_bs:
            return False
        return not batch.shared_prefixes or self.runs_cascade(batch.batch_size)

    def runs_cascade(self, bs: int) -> bool:
        """Whether a decode batch of `bs` requests with shared prefixes replays a graph."""
        return 0 < bs <= self.max_bs and self.padded_size(bs) in self._cascade_batches

    def padded_size(self, bs: int) -> int:
        """The graph a batch of `bs` requests runs on."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a DECODE batch (a view of the graph's output)."""
        if not self.can_run(batch):
            raise ValueError(
                f"graphs run decode batches of 1 to {self.max_bs} requests, "
                f"not a {batch.mode.name} batch of {batch.batch_size}"
            )
        bs = batch.batch_size
        padded = self.padded_size(bs)
        inputs = self._inputs
        if batch.decode_inputs is not None:
            inputs[:, :bs].copy_(batch.decode_inputs)
        else:
            for row, name in enumerate(DECODE_INPUT_FIELDS):
                inputs[row, :bs].copy_(getattr(batch, name))
        if padded > bs:
            # A larger batch may have left real slots here: padding must write slot 0 only.
            inputs[:, bs:padded].copy_(self._padding[:, bs:padded])
        cascade = bool(batch.shared_prefixes)
        static = (self._cascade_batches if cascade else self._batches)[padded]
        static.shared_prefixes = batch.shared_prefixes
        # Host-side lengths for backends that plan on the host (flashinfer).
        pad = padded - bs
        static.seq_lens_cpu = [*batch.seq_lens_cpu, *self._ones_cpu[:pad]]
        static.extend_prefix_lens_cpu = [*batch.extend_prefix_lens_cpu, *self._zeros_cpu[:pad]]
        self.attn.init_forward_metadata_replay(static, bs)
        if self.captured:
            self._graphs[padded, cascade].replay()
            assert self._logits is not None
            logits = self._logits
        else:
            logits = self._run(static, cascade)
        self.num_replays += 1
        return logits[:bs]

    # -- capture ------------------------------------------------------------------
    def _static_batch(self, bs: int) -> ForwardBatch:
        """The batch a graph of `bs` runs on: views of the static buffers. Its host-side
        lengths are the padding's until a replay sets the real batch's in front (only
        host-side plans read them: no captured work does)."""
        inputs = self._inputs
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=inputs[_IDS, :bs],
            positions=inputs[_POS, :bs],
            out_cache_loc=inputs[_LOC, :bs],
            req_pool_indices=inputs[_ROWS, :bs],
            seq_lens=inputs[_LENS, :bs],
            extend_prefix_lens=inputs[_POS, :bs],
            extend_seq_lens=self._ones[:bs],
            extend_start_loc=self._arange[:bs],
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
        )

    def _run(self, batch: ForwardBatch, cascade: bool = False) -> torch.Tensor:
        """The captured pass: the backend's graph metadata, then the model, its logits into
        the shared output buffer (sized at the first pass, the largest, outside any
        capture)."""
        self.attn.init_forward_metadata_capture(batch, cascade)
        if self._logits is None:
            logits = self.model(batch, self.attn, None)
            self._logits = torch.empty(
                (self.max_bs, logits.shape[1]), dtype=logits.dtype, device=logits.device
            )
            return logits
        return self.model(batch, self.attn, self._logits[: batch.batch_size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.kv_pool.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = self.capture_stream = self.capture_stream or torch.cuda.Stream(self.kv_pool.device)
        self.capture_pool = pool  # lab/probes/graph_gaps.py reads it
        for bs in reversed(self.batch_sizes):
            for cascade in (False, True) if bs in self._cascade_batches else (False,):
                batch = (self._cascade_batches if cascade else self._batches)[bs]
                # Warm up on the capture's side stream, as torch.cuda.graph captures on one.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(_WARMUP_PASSES):
                        self._run(batch, cascade)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize(self.kv_pool.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(batch, cascade)
                self._graphs[bs, cascade] = graph
        torch.cuda.synchronize(self.kv_pool.device)
        used = free_before - torch.cuda.mem_get_info(self.kv_pool.device)[0]
        log.info(
            "captured %d decode graphs (batch sizes %s; cascade variants from %s) in %.1f s, "
            "%.0f MiB",
            len(self._graphs),
            self.batch_sizes,
            self.cascade_sizes[0] if self.cascade_sizes else "none",
            time.perf_counter() - started,
            used / 2**20,
        )
