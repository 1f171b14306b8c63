"""The one seam between the model and attention kernels.

The model calls `forward` once per layer; the backend stores the new K/V into the
pool (unless the model has: `kv_stored`) and attends over each request's whole KV
(cached prefix + new tokens, causal within the new tokens). Backends own their
per-batch metadata: `init_forward_metadata` runs once per pass, before the first
layer, so per-layer calls stay cheap.

CUDA graphs (engine/graphs) replay decode passes over fixed buffers, so a backend that
supports them keeps its metadata in buffers of fixed size as well (SGLang's backends
have the same three methods):

- `init_cuda_graph_state(max_bs, max_context_len)` once, before any capture: allocate
  those buffers for batches of up to `max_bs` requests.
- `init_forward_metadata_capture(batch, cascade)` in place of `init_forward_metadata`
  while a graph is captured (and in its warm-up runs), with the graph runner's static
  batch padded to the graph's size. Device work it queues is recorded in the graph, so
  it re-runs on every replay over the inputs then in the static buffers. With
  `cascade`, the graph is the size's cascade variant (attention/cascade.py), which
  backends with `supports_shared_prefix` capture beside the plain one.
- `init_forward_metadata_replay(batch, num_real)` before each replay, once the static
  inputs hold the new batch: metadata that must be computed outside the graph (a
  host-side plan, a cascade step's groups from `batch.shared_prefixes`) is written
  into the fixed buffers here.

Per-layer attention (`LayerAttention`: a sliding window, a logit soft-cap) is set once,
before the first pass (`set_layers`), since a backend that plans on the host (FlashInfer)
plans each kind of layer apart; a backend that runs neither refuses the model there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.engine.forward_batch import ForwardMode

if TYPE_CHECKING:
    import torch

    from radixserve.engine.forward_batch import ForwardBatch
    from radixserve.model_files.config import ModelConfig


# Backends that run windows and soft-caps (named in the refusal of the others).
LAYER_ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention does beyond causal softmax(q k^T * scale) v."""

    # A query at position p sees the keys at positions p - window < j <= p (transformers'
    # sliding_window_overlay: `window` keys, its own included); None: every earlier key.
    window: int | None = None
    # Scores become soft_cap * tanh(score / soft_cap) before the softmax (Gemma 2).
    soft_cap: float | None = None

    def describe(self) -> str:
        parts = [f"window {self.window}"] if self.window is not None else []
        if self.soft_cap is not None:
            parts.append(f"logit soft-cap {self.soft_cap}")
        return " and ".join(parts) or "full attention"


FULL_ATTENTION = LayerAttention()


def layer_attention(config: ModelConfig) -> tuple[LayerAttention, ...]:
    """Each layer's attention, from the model's config (its windows, its soft-cap)."""
    return tuple(LayerAttention(w, config.attn_soft_cap) for w in config.layer_windows)


def check_batch(batch: ForwardBatch) -> None:
    """The lengths the kernels index by must agree; a mismatch would read wrong slots."""
    if batch.batch_size == 0:
        raise ValueError("an attention batch needs at least one request")
    lens = zip(
        batch.seq_lens_cpu, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
    )
    for i, (seq, pre, ext) in enumerate(lens):
        if ext < 1 or seq != pre + ext:
            raise ValueError(
                f"request {i}: seq_len {seq} must equal prefix {pre} + new tokens {ext} (>= 1)"
            )
    if batch.mode == ForwardMode.DECODE and max(batch.extend_seq_lens_cpu) != 1:
        raise ValueError("a DECODE batch must add exactly one token per request")


class AttentionBackend(ABC):
    name: str = "base"
    # Whether decode passes can be captured in CUDA graphs (the methods below work).
    supports_cuda_graph: bool = False
    # Whether decode batches with `shared_prefixes` run cascade attention (attention/
    # cascade.py); a backend without it never gets them from the scheduler.
    supports_shared_prefix: bool = False
    # Whether windows and soft-caps (LayerAttention) run; set_layers refuses them elsewhere.
    supports_layer_attention: bool = False
    layers: tuple[LayerAttention, ...] = ()

    def set_layers(self, layers: Sequence[LayerAttention]) -> None:
        """Each layer's attention, by layer id, before the first pass (default: full
        attention everywhere). Refuses windows or soft-caps the backend does not run,
        rather than attend the full context."""
        special = next((layer for layer in layers if layer != FULL_ATTENTION), None)
        if special is not None and not self.supports_layer_attention:
            raise ValueError(
                f"the {self.name} attention backend does not run this model's "
                f"{special.describe()}; use --attention-backend with one of "
                f"{', '.join(LAYER_ATTENTION_BACKENDS)}"
            )
        self.layers = tuple(layers)
        if special is not None:
            # Cascade's shared-prefix kernels attend the full context without a cap.
            self.supports_shared_prefix = False

    def layer(self, layer_id: int) -> LayerAttention:
        """The attention of layer `layer_id` (full where set_layers named none)."""
        layers = self.layers
        return layers[layer_id] if layer_id < len(layers) else FULL_ATTENTION

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare index tables/masks for this batch (called once per forward pass)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (new tokens only)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v to batch.kv_pool at batch.out_cache_loc (unless `kv_stored`: the
        caller has written them, e.g. the rotary kernel did), then attend."""

    # -- decode CUDA graphs (prefill pieces keep attention eager) -----------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the fixed metadata buffers for decode graphs of up to `max_bs` requests
        of up to `max_context_len` tokens each."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graph support")

    def init_forward_metadata_capture(self, batch: ForwardBatch, cascade: bool = False) -> None:
        """Metadata for a decode pass over the graph runner's static, padded batch, from
        the fixed buffers; device work queued here is part of the captured graph. With
        `cascade`, a cascade pass whose groups each replay writes first."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graph support")

    def init_forward_metadata_replay(self, batch: ForwardBatch, num_real: int) -> None:
        """Before a replay of `batch`'s graph, whose first `num_real` requests are real
        (the rest padding). Nothing by default: for backends whose metadata is rebuilt
        inside the graph."""
        return None

    def use_side_stream(self, stream: torch.cuda.Stream) -> None:
        """Run any work beside the main stream on `stream` rather than on a stream of the
        backend's own: the runner hands it the decode graphs' capture stream, idle after
        start-up, because work on any stream made after their capture leaves their
        Triton kernels launching plainly
        (lab/notebook/2026-11-29-h200-capture-order-measured-flashinfer-side.md). Nothing by default."""
        return None

    # -- kernels compiled in the background ----------------------------------------
    def start_kernel_builds(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        """Start compiling, in the background, kernels the backend switches to once they
        are built (for the model's head layout and dtype). None by default."""
        return None

    def wait_kernel_builds(self, timeout: float) -> bool:
        """Wait up to `timeout` s for those builds; whether every one ended built (True
        where there are none). For benchmarks and tests."""
        return True
