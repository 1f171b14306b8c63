"""Attention through FlashInfer's paged kernels: CUDA, float16 and bfloat16.

The pool is token-granular (req_to_token holds a slot for every position whatever the
page size), so FlashInfer sees it as pages of ONE slot: K/V buffers [slots, heads, d]
are viewed as [slots, 1, heads, d], kv_indices are slots, every last page holds one
token. That view is valid for every pool page size, and the slot tables are the ones
the Triton backend builds (triton_ops/indices.py), on the device from req_to_token.

Per forward pass one wrapper runs every layer, planned once (at the first layer,
when the head shape, dtype and softmax scale are known); a model whose layers differ in
their window or soft-cap (LayerAttention: FlashInfer's `window_left`, the window less
the query's own key, and `logits_soft_cap`, both fixed at plan time) has one wrapper per
kind of layer, each planned over the same tables:

- decode (every request adds one token): BatchDecodeWithPagedKVCacheWrapper, with
  tensor cores (FlashInfer's prefill kernel) from 4 query heads per KV head up, as
  SGLang does: it folds the head group into the query tile;
- anything else, mixed batches included: BatchPrefillWithPagedKVCacheWrapper over the
  whole sequences (cached prefix + the new tokens, which each layer first writes to
  the pool), causal within the new tokens (FlashInfer aligns the causal mask to the
  end of the KV). Decode requests of a mixed batch are extend requests of length 1.

FlashInfer plans on the host: it reads indptr arrays as host tensors and computes the
work split from them. They are built here from the batch's host-side lengths, in
pinned memory, so a plan never waits for the device (FlashInfer would copy device
indptrs back, a sync).

Decode batches with shared prefixes run cascade attention (attention/cascade.py, Triton
kernels) instead of a wrapper: the group's prefix is read once for all its members. In a
mixed batch the decoders' cascade runs on a side stream beside the prefill wrapper over
the prompts (memory-bound beside compute-bound kernels; measured:
lab/notebook/2026-11-25-mixed-step-decoders-beside-prefill-gemm.md).

CUDA graphs (decode only): one wrapper per graph batch size, created with
`use_cuda_graph=True` over views of fixed buffers (kv_indptr, kv_indices,
last_page_len), per kind of layer. It is planned in the warm-up passes before capture (never during the
capture: plan copies host memory), and re-planned before each replay from the
lengths the graph runner puts in the static batch: the plan writes the new tables and
work split into the fixed buffers the captured kernels read.

An FP8 pool (e4m3 codes) is planned with `kv_data_type` float8_e4m3fn beside 16-bit
queries; each layer's run takes its K/V scales (FlashInfer folds k_scale into the
softmax scale and multiplies the output by v_scale). Decode then runs on tensor cores
whatever the head group, as SGLang does for FP8 caches. The SM90 prefill is off for
them: its kernels take FP8 K/V only beside FP8 queries.

Kernels are JIT-compiled by FlashInfer on first use (nvcc; cached under
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer). Prefill passes run FA2's kernels, or on
Hopper the SM90 (fa3) ones where long prompts dominate the pass (attention/
sm90_prefill.py: ~1.6x faster on long query blocks, 3-5x slower on requests adding a few
tokens; built in the background at start-up, FA2 meanwhile; opt-in:
`enable_sm90_prefill`; models with windows or soft-caps stay on FA2). A mixed batch's
leading decoders then run Triton's decode kernel after the SM90 one (or cascade, where
they share prefixes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.engine.attention.base import (
    FULL_ATTENTION,
    AttentionBackend,
    LayerAttention,
    check_batch,
)
from radixserve.engine.attention.cascade import CascadeDecode, CascadeGraph, CascadePass
from radixserve.engine.attention.sm90_prefill import (
    HeadLayout,
    Sm90Build,
    is_sm90,
    sm90_build,
    use_sm90,
)
from radixserve.engine.attention.triton_backend import DecodeRows
from radixserve.engine.attention.triton_ops.indices import build_kv_indices
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8_format import FP8_DTYPE

if TYPE_CHECKING:
    from radixserve.engine.forward_batch import ForwardBatch

DTYPES = (torch.float16, torch.bfloat16)
# Split-KV partial results of every wrapper (they never run at the same time).
WORKSPACE_BYTES = 384 * 2**20
# Query heads per KV head from which decode runs on tensor cores (SGLang's threshold).
TENSOR_CORE_GROUP = 4
_KERNELS = "fa2"
_NOT_INSTALLED = (
    "flashinfer is not installed: pip install flashinfer-python, or use --attention-backend triton"
)


def import_flashinfer() -> Any:
    """The flashinfer module, or a RuntimeError saying how to get it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(_NOT_INSTALLED) from exc
    return flashinfer


@dataclass(frozen=True)
class _Layout:
    """What a plan is made for; the same for every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float
    kv_dtype: torch.dtype  # the pool's: dtype, or FP8 codes


@dataclass
class _Pass:
    """One forward pass's plan inputs; planned at its first layer."""

    decode: bool
    kv_indptr: torch.Tensor  # [bs + 1] int32, pinned host, over the whole sequences
    kv_indices: torch.Tensor  # int32 slots, on the device
    qo_indptr: torch.Tensor | None  # [bs + 1] int32, pinned host (extend only)
    graph_bs: int | None = None  # the graph size whose wrapper runs it
    first: int = 0  # its first request and token row (the ones before run cascade)
    kernels: str = _KERNELS  # the prefill's kernel family: fa2, or fa3 (SM90)
    # Each kind of layer's planned wrapper (empty until planned, at the first layer).
    wrappers: dict[LayerAttention, Any] = field(default_factory=dict)


@dataclass
class _GraphState:
    max_bs: int
    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int32
    last_page_len: torch.Tensor  # [max_bs] int32
    # (graph batch size, kind of layer) -> its planned decode wrapper
    wrappers: dict[tuple[int, LayerAttention], Any]
    max_context_len: int
    cascade: CascadeGraph | None = None  # the cascade graphs' tables, at their first capture


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    supports_shared_prefix = True
    supports_layer_attention = True

    def __init__(
        self, device: torch.device, dtype: torch.dtype | None = None, sm90_prefill: bool = False
    ) -> None:
        """`sm90_prefill`: on Hopper, run prefill passes that long prompts dominate on the
        SM90 kernels once they are built (start_kernel_builds, or the first pass)."""
        self._fi = import_flashinfer()
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs CUDA, not {device.type}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(
                f"the flashinfer attention backend runs float16 or bfloat16 models, not {dtype}; "
                "use --attention-backend triton"
            )
        self.device = device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._layout: _Layout | None = None
        self._pass: _Pass | None = None
        self._cascade: CascadePass | None = None
        # A mixed batch's leading decoders beside an SM90 prefill (Triton's decode).
        self._decoders: DecodeRows | None = None
        # (kernel family, kind of layer) -> its prefill wrapper; kind -> its decode wrapper.
        self._prefill: dict[tuple[str, LayerAttention], Any] = {}
        self._decode: dict[LayerAttention, Any] = {}
        self._sm90_wanted = sm90_prefill and is_sm90(device)
        self._sm90: Sm90Build | None = None  # its build, once started
        self._graph: _GraphState | None = None
        # Every page of the one-slot view is full: last_page_len is all ones.
        self._ones = torch.ones(256, dtype=torch.int32, pin_memory=True)
        # Per wrapper: an event behind its last plan's copy to the device (see _plan).
        self._plan_copied: dict[int, torch.cuda.Event] = {}
        # Where a mixed batch's cascade rows run beside its prefill wrapper (forward).
        self._stream: torch.cuda.Stream | None = None

    def set_layers(self, layers: Sequence[LayerAttention]) -> None:
        super().set_layers(layers)
        if any(layer != FULL_ATTENTION for layer in layers):
            self._sm90_wanted = False  # its windows and caps are not checked here

    def _kinds(self) -> tuple[LayerAttention, ...]:
        """The distinct kinds of layer, one wrapper each (full attention by default)."""
        return tuple(dict.fromkeys(self.layers)) or (FULL_ATTENTION,)

    # -- per batch ------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        check_batch(batch)
        self._cascade = None
        self._decoders = None
        self._pass = None
        if batch.shared_prefixes:
            # The leading one-token rows run cascade; the rest (a mixed batch's prefills,
            # their tokens the tail of q) run the prefill wrapper.
            self._cascade = CascadeDecode(batch)
            first = self._cascade.rows
            if first < batch.batch_size:
                kernels = self._prefill_kernels(batch, first)
                self._pass = self._new_pass(batch, decode=False, first=first, kernels=kernels)
            return
        if max(batch.extend_seq_lens_cpu) == 1:
            self._pass = self._new_pass(batch, decode=True)
            return
        first = batch.cascade_rows
        if first and self._prefill_kernels(batch, first) == "fa3":
            # The SM90 kernel is 3-5x slower on one-token requests: the leading decoders
            # run Triton's decode after it instead.
            self._decoders = DecodeRows(batch, first)
            self._pass = self._new_pass(batch, decode=False, first=first, kernels="fa3")
            return
        kernels = self._prefill_kernels(batch, 0)
        self._pass = self._new_pass(batch, decode=False, kernels=kernels)

    def _prefill_kernels(self, batch: ForwardBatch, first: int) -> str:
        """fa3 where the SM90 kernels are built and pay for requests [first:] (those
        before run cascade or Triton's decode beside them), else FA2's."""
        if self._sm90 is None or not self._sm90.ready:
            return _KERNELS
        new, lens = batch.extend_seq_lens_cpu[first:], batch.seq_lens_cpu[first:]
        return "fa3" if use_sm90(new, lens, beside_cascade=first > 0) else _KERNELS

    def _new_pass(
        self,
        batch: ForwardBatch,
        decode: bool,
        graph_bs: int | None = None,
        first: int = 0,
        kernels: str = _KERNELS,
    ) -> _Pass:
        """The pass over requests [first:] (their tokens: q's rows from `first` on, since
        the requests before add one token each); `kernels`: an extend pass's family."""
        lens = batch.seq_lens_cpu[first:]
        _, kv_indices = build_kv_indices(
            batch.req_to_token, batch.req_pool_indices[first:], batch.seq_lens[first:], sum(lens)
        )
        qo_indptr = None if decode else _host_indptr(batch.extend_seq_lens_cpu[first:])
        return _Pass(decode, _host_indptr(lens), kv_indices, qo_indptr, graph_bs, first, kernels)

    # -- kernels built in the background ------------------------------------------------
    def start_kernel_builds(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        if self._sm90_wanted and self._sm90 is None and dtype in DTYPES:
            layout = HeadLayout(self.device, num_heads, num_kv_heads, head_dim, dtype)
            self._sm90 = sm90_build(self._fi, layout)

    def wait_kernel_builds(self, timeout: float) -> bool:
        return self._sm90 is None or self._sm90.wait(timeout)

    @property
    def prefill_kernels(self) -> str | None:
        """The kernel family of this pass's prefill wrapper (fa2 or fa3), if it has one."""
        step = self._pass
        return None if step is None or step.qo_indptr is None else step.kernels

    # -- CUDA graphs ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        device = self.device
        self._graph = _GraphState(
            max_bs=max_bs,
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=device),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=device),
            wrappers={},
            max_context_len=max_context_len,
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch, cascade: bool = False) -> None:
        graph = self._graph_for(batch)
        self._cascade = None
        self._decoders = None
        bs = batch.batch_size
        if cascade:
            # Triton kernels over the shared kv_indices buffer (a pass runs a wrapper or
            # cascade, never both).
            self._pass = None
            if graph.cascade is None:
                graph.cascade = CascadeGraph(
                    graph.max_bs, graph.max_context_len, graph.kv_indices, self.device
                )
            self._cascade = graph.cascade.capture(batch)
            return
        if not torch.cuda.is_current_stream_capturing():
            # A warm-up pass: planned at its first layer, outside the capture.
            self._pass = self._new_pass(batch, decode=True, graph_bs=bs)
            return
        planned = {kind: graph.wrappers.get((bs, kind)) for kind in self._kinds()}
        if self._pass is None or self._pass.wrappers != planned:
            raise RuntimeError("a decode graph is captured only after a warm-up pass of its size")
        # The capture records the kernels the warm-up planned; nothing is queued here.

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        graph = self._graph_for(batch)
        self._cascade = None
        self._decoders = None
        if batch.shared_prefixes:
            assert graph.cascade is not None, "a cascade graph is replayed only after capture"
            graph.cascade.write(batch, num_real)
            return
        if self._layout is None:
            raise RuntimeError("a decode graph is replayed only after it was captured")
        self._pass = self._new_pass(batch, decode=True, graph_bs=batch.batch_size)
        self._plan(self._pass, self._layout)

    def _graph_for(self, batch: ForwardBatch) -> _GraphState:
        graph = self._graph
        if graph is None:
            raise RuntimeError("init_cuda_graph_state must run before a graph is captured")
        if batch.mode != ForwardMode.DECODE or batch.batch_size > graph.max_bs:
            raise ValueError(f"graphs capture decode batches of up to {graph.max_bs} requests")
        return graph

    # -- per layer ------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        step = self._pass
        if step is None and self._cascade is None:
            raise RuntimeError("init_forward_metadata must run before the first layer")
        num_tokens, num_heads, head_dim = q.shape
        pool = batch.kv_pool
        layout = _Layout(num_heads, k.shape[1], head_dim, q.dtype, scale, pool.dtype)
        if layout != self._layout:
            self._check_layout(layout)
        if not kv_stored:
            pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buffer = pool.k_buffers[layer_id]
        v_buffer = pool.v_buffers[layer_id]
        kv_scale = pool.scales[layer_id]
        # None where 1.0: no output multiply (FlashInfer's v_scale is a kernel of its own).
        run_scales = {
            "k_scale": None if kv_scale.k == 1.0 else kv_scale.k,
            "v_scale": None if kv_scale.v == 1.0 else kv_scale.v,
        }
        if self._cascade is not None and step is None:
            return self._cascade.forward(q, k_buffer, v_buffer, scale, kv_scale=kv_scale)
        assert step is not None
        if not step.wrappers:
            self._plan(step, layout)
        wrapper = step.wrappers[self.layer(layer_id)]
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        first = step.first
        paged = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # pages of one slot (NHD)
        if not isinstance(self._cascade, CascadeDecode):
            wrapper.run(q[first:], paged, out=out[first:], **run_scales)
            if self._decoders is not None:
                self._decoders.forward(q, k_buffer, v_buffer, out, scale, kv_scale)
            return out
        # A mixed batch: the decoders' cascade (memory-bound) runs on a side stream beside
        # the prompts' prefill (compute-bound) on this one, launched after it (its small
        # programs fill what the prefill's leave free: 8.41-8.42 s of mixed steps against
        # 8.45-8.46 s the other way round). Every tensor the side stream touches was made
        # on this stream before the fork, and this stream waits for it before the layer's
        # output is read.
        self._cascade.prepare(q[:first], k_buffer.shape[1])
        main = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(main)
        wrapper.run(q[first:], paged, out=out[first:], **run_scales)
        with torch.cuda.stream(side):
            self._cascade.forward(
                q[:first], k_buffer, v_buffer, scale, out=out[:first], kv_scale=kv_scale
            )
        main.wait_stream(side)
        return out

    def use_side_stream(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # no decode graphs: a stream of its own
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _check_layout(self, layout: _Layout) -> None:
        """The first layer fixes the layout every plan is made for; later ones must match."""
        if self._layout is not None:
            raise ValueError(
                f"a layer's attention {layout} differs from the first's {self._layout}"
            )
        if layout.dtype not in DTYPES or layout.kv_dtype not in (layout.dtype, FP8_DTYPE):
            raise ValueError(
                f"the flashinfer attention backend runs float16 or bfloat16 q over KV of the "
                f"same dtype or FP8, not q {layout.dtype} over KV {layout.kv_dtype}"
            )
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(
                f"{layout.num_heads} query heads do not split over {layout.num_kv_heads} KV heads"
            )
        self._layout = layout
        if layout.kv_dtype == FP8_DTYPE:
            self._sm90_wanted = False  # FP8 K/V only beside FP8 queries there
        # Where the runner did not start them (a backend used on its own).
        self.start_kernel_builds(
            layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.dtype
        )

    # -- plans ------------------------------------------------------------------------
    def _plan(self, step: _Pass, layout: _Layout) -> None:
        """Plan `step` on its wrappers, one per kind of layer (host work and host-to-device
        copies, no sync)."""
        for kind in self._kinds():
            wrapper = (
                self._prefill_wrapper(step.kernels, kind)
                if step.qo_indptr is not None
                else self._decode_wrapper(layout, step.graph_bs, kind)
            )
            # A plan fills the wrapper's pinned buffer and queues its copy to the device.
            # With overlap scheduling the next plan of this wrapper can come before that
            # copy has run: wait for it (it is queued right behind the step whose tokens
            # the scheduler has just read, so this rarely waits at all).
            done = self._plan_copied.get(id(wrapper))
            if done is not None:
                done.synchronize()
            self._plan_on(wrapper, step, layout, kind)
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self._plan_copied[id(wrapper)] = event

    def _plan_on(self, wrapper: Any, step: _Pass, layout: _Layout, kind: LayerAttention) -> None:
        bs = step.kv_indptr.shape[0] - 1
        last_page_len = self._ones_host(bs)
        shape = (layout.num_heads, layout.num_kv_heads, layout.head_dim, 1)  # page size 1
        options = {
            "q_data_type": layout.dtype,
            "kv_data_type": layout.kv_dtype,
            # FlashInfer's window counts the keys left of the query's own.
            "window_left": -1 if kind.window is None else kind.window - 1,
            "logits_soft_cap": kind.soft_cap,
        }
        if step.qo_indptr is not None:
            wrapper.plan(
                step.qo_indptr,
                step.kv_indptr,
                step.kv_indices,
                last_page_len,
                *shape,
                causal=True,
                sm_scale=layout.scale,
                **options,
            )
        else:
            wrapper.plan(
                step.kv_indptr,
                step.kv_indices,
                last_page_len,
                *shape,
                sm_scale=layout.scale,
                **options,
            )
        step.wrappers[kind] = wrapper

    def _prefill_wrapper(self, kernels: str, kind: LayerAttention) -> Any:
        wrapper = self._prefill.get((kernels, kind))
        if wrapper is None:
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=kernels
            )
            self._prefill[(kernels, kind)] = wrapper
        return wrapper

    def _decode_wrapper(self, layout: _Layout, graph_bs: int | None, kind: LayerAttention) -> Any:
        tensor_cores = (
            layout.num_heads // layout.num_kv_heads >= TENSOR_CORE_GROUP
            or layout.kv_dtype == FP8_DTYPE
        )
        wrapper_cls = self._fi.BatchDecodeWithPagedKVCacheWrapper
        if graph_bs is None:
            if kind not in self._decode:
                self._decode[kind] = wrapper_cls(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores, backend=_KERNELS
                )
            return self._decode[kind]
        graph = self._graph
        assert graph is not None
        wrapper = graph.wrappers.get((graph_bs, kind))
        if wrapper is None:
            wrapper = wrapper_cls(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=graph.kv_indptr[: graph_bs + 1],
                paged_kv_indices_buffer=graph.kv_indices,
                paged_kv_last_page_len_buffer=graph.last_page_len[:graph_bs],
                backend=_KERNELS,
            )
            graph.wrappers[(graph_bs, kind)] = wrapper
        return wrapper

    def _ones_host(self, n: int) -> torch.Tensor:
        if self._ones.shape[0] < n:
            self._ones = torch.ones(2 * n, dtype=torch.int32, pin_memory=True)
        return self._ones[:n]


def _host_indptr(lens: list[int]) -> torch.Tensor:
    """[0, cumsum(lens)] as int32 in pinned host memory: FlashInfer plans from host
    indptrs, and copies from pinned memory do not wait for the device."""
    return torch.tensor(
        list(itertools.accumulate(lens, initial=0)), dtype=torch.int32, pin_memory=True
    )
