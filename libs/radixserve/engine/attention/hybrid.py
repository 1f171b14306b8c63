"""One backend for decode passes, another for everything else (SGLang's hybrid backends).

The fastest kernels differ by pass: on an H100 FlashInfer's FA2 prefill serves long
cached prefixes beside hundreds of decoders better than the Triton extend kernel, while
Triton's decode runs its slot tables inside the CUDA graph and FlashInfer re-plans on
the host before every replay (lab/notebook/2026-11-23-auto-flashinfer-prefill-triton-decode-kernel.md).
`auto` therefore pairs FlashInfer's
prefill with Triton's decode where FlashInfer is installed (runner.make_attention_backend);
`--prefill-attention-backend` and `--decode-attention-backend` pick any pair.

A pass goes to one backend whole: DECODE batches (every request adds one token: the only
ones CUDA graphs capture) to `decode`, EXTEND batches (prefills, and mixed batches whose
decoders extend by one) to `prefill`. Each backend keeps its own per-pass metadata, so
the two never share state; the graph methods go to `decode` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.engine.attention.base import AttentionBackend, LayerAttention
from radixserve.engine.forward_batch import ForwardMode

if TYPE_CHECKING:
    import torch

    from radixserve.engine.forward_batch import ForwardBatch


class HybridAttentionBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.name = f"{prefill.name}+{decode.name}"
        self.supports_cuda_graph = decode.supports_cuda_graph
        # Mixed batches with shared prefixes run on the prefill side, decode ones on the
        # decode side: both must run cascade for the scheduler to hand it groups.
        self.supports_shared_prefix = (
            prefill.supports_shared_prefix and decode.supports_shared_prefix
        )
        self.supports_layer_attention = (
            prefill.supports_layer_attention and decode.supports_layer_attention
        )
        self._active: AttentionBackend | None = None

    def set_layers(self, layers: Sequence[LayerAttention]) -> None:
        self.prefill.set_layers(layers)
        self.decode.set_layers(layers)
        self.layers = tuple(layers)
        self.supports_shared_prefix = (
            self.prefill.supports_shared_prefix and self.decode.supports_shared_prefix
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._active = self.decode if batch.mode == ForwardMode.DECODE else self.prefill
        self._active.init_forward_metadata(batch)

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
        if self._active is None:
            raise RuntimeError("init_forward_metadata must run before the first layer")
        return self._active.forward(q, k, v, layer_id, batch, scale, kv_stored)

    def start_kernel_builds(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        self.prefill.start_kernel_builds(num_heads, num_kv_heads, head_dim, dtype)
        self.decode.start_kernel_builds(num_heads, num_kv_heads, head_dim, dtype)

    def wait_kernel_builds(self, timeout: float) -> bool:
        prefill = self.prefill.wait_kernel_builds(timeout)
        return self.decode.wait_kernel_builds(timeout) and prefill

    def use_side_stream(self, stream: torch.cuda.Stream) -> None:
        self.prefill.use_side_stream(stream)
        self.decode.use_side_stream(stream)

    # -- CUDA graphs: decode passes only ----------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_context_len)

    def init_forward_metadata_capture(self, batch: ForwardBatch, cascade: bool = False) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_capture(batch, cascade)

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_replay(batch, num_real)
