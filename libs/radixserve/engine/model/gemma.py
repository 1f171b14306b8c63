"""Gemma 2 and Gemma 3 text models: the Llama-family decoder (model/llama.py) with
Gemma's differences, in transformers' op order:

- the embeddings scaled by sqrt(hidden_size) (rounded to the weights' dtype first, as
  transformers does);
- RMSNorm by (1 + weight): the checkpoint's weights are stored plus one at load, so
  every norm runs the Llama kernels (`norm.weight` is then what they multiply by);
- sandwich norms: the attention's output is normed before the residual add, and the
  MLP sits between pre- and post-feed-forward norms;
- GeGLU: gelu (tanh approximation) of the gate times up;
- attention scaled by query_pre_attn_scalar ** -0.5; Gemma 2's attention logit
  soft-cap and every layer's window are the attention backend's (attention/base.py
  LayerAttention, from ModelConfig); the final logits soft-capped;
- Gemma 3: q/k norms over head_dim (Llama's qk_norm), and its local (sliding) layers
  rotate by their own base (rope_local_base_freq).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.engine.distributed import SINGLE, TPGroup
from radixserve.engine.kernels.linear import add_norm_linear
from radixserve.engine.kernels.norm import rms_norm
from radixserve.engine.kernels.rotary import Rotation
from radixserve.engine.model.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    VocabParallelEmbedding,
)
from radixserve.engine.model.quantization import weight_of
from radixserve.engine.model.rope import RotaryTable
from radixserve.engine.model.weights import StoredTensor
from radixserve.model_files.config import ModelConfig

if TYPE_CHECKING:
    from radixserve.engine.kvcache.pool import KVPool


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma's fields beyond ModelConfig, with transformers' defaults."""

    query_pre_attn_scalar: float
    final_soft_cap: float | None  # logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None  # Gemma 3's sliding layers; None: one rope for all

    @classmethod
    def of(cls, config: ModelConfig) -> GemmaConfig:
        raw = config.raw
        gemma3 = config.architecture == "Gemma3ForCausalLM"
        final = raw.get("final_logit_softcapping", None if gemma3 else 30.0)
        local = None
        if gemma3:
            per_type = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
            local = float(per_type.get("rope_theta") or raw.get("rope_local_base_freq", 10000.0))
        return cls(
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            final_soft_cap=None if final is None else float(final),
            local_rope_theta=local,
        )


class ScaledEmbedding(VocabParallelEmbedding):
    """The embeddings times sqrt(hidden_size), the factor rounded to their dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.scale = hidden_size**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rounded = torch.tensor(self.scale, dtype=self.weight.dtype).item()
        return super().forward(input_ids) * rounded


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its attention, norms and gate_up/down projections) with the
    pre/post feed-forward norms and GeGLU; `local_rotary`: a sliding layer's own rope."""

    def __init__(
        self, config: ModelConfig, gemma: GemmaConfig, layer_id: int, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(config, layer_id, tp)
        self.self_attn.scale = gemma.query_pre_attn_scalar**-0.5
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.local_rotary: RotaryTable | None = None

    def pre_attention(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        kv_pool: KVPool,
        loc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.Tensor]:
        if self.local_rotary is not None:
            rotation = Rotation.of(self.local_rotary, rotation.positions)
        return super().pre_attention(hidden, residual, rotation, kv_pool, loc)

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-feed-forward-normed MLP output, residual stream before it)."""
        post = self.post_attention_layernorm
        hidden = rms_norm(self.self_attn.project_out(out), post.weight, post.eps)
        norm, proj = self.pre_feedforward_layernorm, self.mlp.gate_up_proj
        gate_up, residual = add_norm_linear(
            hidden, residual, norm.weight, norm.eps, weight_of(proj), proj.bias
        )
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        mlp_out = self.mlp(F.gelu(gate, approximate="tanh") * up)
        ff = self.post_feedforward_layernorm
        return rms_norm(mlp_out, ff.weight, ff.eps), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Build on the meta device (load_model does), then `init_rotary` and `load_weights`."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(dataclasses.replace(config, num_hidden_layers=0), tp)
        self.config = config
        self.gemma = GemmaConfig.of(config)
        self.model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, tp)
        self.model.layers = nn.ModuleList(
            GemmaDecoderLayer(config, self.gemma, i, tp) for i in range(config.num_hidden_layers)
        )
        self.tie_weights()

    def init_rotary(self, max_positions: int | None = None) -> None:
        """The global table (Llama's), and Gemma 3's local one for its sliding layers."""
        super().init_rotary(max_positions)
        if self.gemma.local_rope_theta is None:
            return
        weight = self.model.embed_tokens.weight
        local_config = dataclasses.replace(
            self.config, rope_theta=self.gemma.local_rope_theta, rope_scaling=None
        )
        local = RotaryTable(
            local_config,
            max_positions or self.config.max_position_embeddings,
            weight.dtype,
            weight.device,
        )
        for layer, window in zip(self.model.layers, self.config.layer_windows, strict=True):
            if window is not None and isinstance(layer, GemmaDecoderLayer):
                layer.local_rotary = local

    def _head(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Llama's head, then the final soft-cap (in place: `out` may be the graphs')."""
        logits = super()._head(hidden, residual, rows, out)
        cap = self.gemma.final_soft_cap
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _copy_shard(
        self, param: torch.Tensor, target: str, shard: int, stored: StoredTensor
    ) -> None:
        """Llama's copy; a norm's weight w is stored as 1 + w (Gemma's norm multiplies by it)."""
        super()._copy_shard(param, target, shard, stored)
        if target.endswith("norm.weight"):
            param.add_(1.0)
