"""Prefill and mixed passes of few tokens captured as CUDA graphs, piece by piece.

Why: a pass of a few hundred new tokens (a short prompt, or a new prompt beside a few
decoders) is bound by the host: the GPU waits for some 800 eager launches from Python
(measured: lab/notebook/2026-11-27-ttft-step-by-step.md).
That pass sets the time to first token at light load and the inter-token spikes of the
decoders beside it.

How (SGLang's piecewise CUDA graphs, without torch.compile): attention varies with the
requests' lengths and its backend plans it per batch, so it stays eager; everything
between two attention calls is captured. A pass of a model of L layers is L + 1 pieces:

    piece 0:  embed, layer 0 up to attention (norm, qkv, rotary + K/V store)
    piece i:  layer i-1 after attention (o_proj, norm, MLP), layer i up to attention
    piece L:  layer L-1 after attention

with eager attention between pieces, and the final norm and head (at each request's
last token, and the prompt logprobs) eager after the last. Pieces are captured for a
ladder of token counts (`token_buckets`); a pass runs on the smallest that holds it,
its tokens padded with token 0 at position 0 whose K/V go to the reserved slot 0.

Pieces hand each other their results through static buffers (q, k, v, the residual
stream, the attention output, the last hidden states), sized for the largest bucket and
shared by all; each piece copies its results there (a few microseconds a layer at 512
tokens). Attention reads the static q, k and v of the real tokens only, and its output
is copied into the static buffer the next piece reads. Padding rows never mix with
real ones: every captured op works row by row.

With `capture=False` the pieces run eagerly over the same padded static buffers: the
CPU tests check the padding and the hand-offs that way, where there is no CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, cast

import torch

from radixserve.engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.engine.attention.base import AttentionBackend
    from radixserve.engine.kvcache.pool import KVPool
    from radixserve.engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

# Rows of the static input buffer.
_IDS, _POS, _LOC = 0, 1, 2
_WARMUP_PASSES = 2  # per bucket before its capture: kernels compile outside it


def token_buckets(max_tokens: int) -> list[int]:
    """8, 16, 32, 64, 96, 128, then steps of 64 up to 256, then of 128, up to and
    including `max_tokens` (a pass pads to the next: at most ~50% padding at 8-16
    tokens, where the pass costs the GPU next to nothing, ~33% at most past 64)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ladder = {8, 16, 32, 64, 96, 128, 192, 256, *range(384, max_tokens + 1, 128)}
    return sorted({t for t in ladder if t <= max_tokens} | {max_tokens})


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        kv_pool: KVPool,
        max_tokens: int,
        stream: torch.cuda.Stream | None = None,
        capture: bool = True,
    ) -> None:
        """`stream`: the capture stream (a new one if None)."""
        if capture and kv_pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.layers = cast("list[LlamaDecoderLayer]", list(model.model.layers))
        self.attn = attn
        self.kv_pool = kv_pool
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.captured = capture
        self.num_replays = 0  # tests and benchmarks check the pieces ran
        device = kv_pool.device
        first = self.layers[0].self_attn
        hidden_size = model.config.hidden_size
        dtype = model.model.embed_tokens.weight.dtype
        t = self.max_tokens
        with torch.inference_mode():
            self._inputs = torch.zeros((3, t), dtype=torch.int64, device=device)

            def buffer(*shape: int) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=device)

            self._q = buffer(t, first.num_heads, first.head_dim)
            self._k = buffer(t, first.num_kv_heads, first.head_dim)
            self._v = buffer(t, first.num_kv_heads, first.head_dim)
            self._attn_out = buffer(t, first.q_size)
            self._residual = buffer(t, hidden_size)
            self._hidden = buffer(t, hidden_size)
        self._stored = False  # whether the pieces store K/V (the rotary kernel does)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_stream = stream  # a new one at capture if None
        if capture:
            try:
                self._capture_all()
            except torch.OutOfMemoryError as exc:
                raise RuntimeError(
                    f"out of GPU memory capturing prefill pieces of up to {self.max_tokens} "
                    "tokens: lower piecewise_cuda_graph_max_tokens or mem_fraction_static"
                ) from exc
        else:
            with torch.inference_mode():  # what capture would have learnt (stored)
                self._run_pieces(self.buckets[0])

    def close(self) -> None:
        """Destroy the captured pieces now, whoever still holds them (see
        CudaGraphRunner.close: their all-reduces would hold the tensor-parallel group)."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.max_tokens = 0  # can_run: nothing from now on

    def can_run(self, batch: ForwardBatch) -> bool:
        return 0 < batch.num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        """The bucket a pass of `num_tokens` runs on."""
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The pass's logits [batch_size, vocab] (and its prompt logprobs, where asked)."""
        if not self.can_run(batch):
            raise ValueError(
                f"prefill pieces run passes of 1 to {self.max_tokens} tokens, "
                f"not {batch.num_tokens}"
            )
        n = batch.num_tokens
        padded = self.padded_size(n)
        inputs = self._inputs
        inputs[_IDS, :n].copy_(batch.input_ids)
        inputs[_POS, :n].copy_(batch.positions)
        inputs[_LOC, :n].copy_(batch.out_cache_loc)
        if padded > n:
            # A larger pass may have left real slots here: padding writes slot 0 only.
            inputs[:, n:padded].zero_()
        self.attn.init_forward_metadata(batch)
        q, k, v, attn_out = self._q[:n], self._k[:n], self._v[:n], self._attn_out[:n]
        for i, layer in enumerate(self.layers):
            self._piece(i, padded)
            attn_out.copy_(layer.self_attn.attend(q, k, v, self._stored, batch, self.attn))
        self._piece(len(self.layers), padded)
        self.num_replays += 1
        return self.model.finish(self._hidden[:n], self._residual[:n], batch)

    def _piece(self, i: int, tokens: int) -> None:
        if self.captured:
            self._graphs[tokens, i].replay()
        else:
            self._eager_piece(i, tokens)

    def _eager_piece(self, i: int, tokens: int) -> None:
        """Piece `i` over the first `tokens` static rows (see the module docstring)."""
        residual: torch.Tensor | None
        if i == 0:
            hidden = self.model.model.embed_tokens(self._inputs[_IDS, :tokens])
            residual = None
        else:
            hidden, residual = self.layers[i - 1].post_attention(
                self._attn_out[:tokens], self._residual[:tokens]
            )
        if i == len(self.layers):
            assert residual is not None
            self._hidden[:tokens].copy_(hidden)
            self._residual[:tokens].copy_(residual)
            return
        rotation = self.model.rotation(self._inputs[_POS, :tokens])
        q, k, v, stored, residual = self.layers[i].pre_attention(
            hidden, residual, rotation, self.kv_pool, self._inputs[_LOC, :tokens]
        )
        self._q[:tokens].copy_(q)
        self._k[:tokens].copy_(k)
        self._v[:tokens].copy_(v)
        self._residual[:tokens].copy_(residual)
        self._stored = stored

    def _run_pieces(self, tokens: int) -> None:
        """Every piece of a pass over `tokens` static rows, eagerly, without attention
        (the capture's warm-up: the static inputs read the reserved slot 0 only)."""
        for i in range(len(self.layers) + 1):
            self._eager_piece(i, tokens)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        device = self.kv_pool.device
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = self.capture_stream = self.capture_stream or torch.cuda.Stream(device)
        for tokens in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP_PASSES):
                    self._run_pieces(tokens)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(device)
            for i in range(len(self.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._eager_piece(i, tokens)
                self._graphs[tokens, i] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        log.info(
            "captured prefill pieces for %d token counts (%s) in %.1f s, %.0f MiB",
            len(self.buckets),
            self.buckets,
            time.perf_counter() - started,
            used / 2**20,
        )
