"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (model/llama.py) with a
sparse MoE block (model/moe.py) for the MLP of its sparse layers.

The three differ only in their config (MoEConfig: routing normalisation, the shared
expert, which layers are sparse) and their checkpoint names, so one class serves them.
Checkpoints store each expert apart (`experts.{e}.w1/w3/w2`, Mixtral; `gate_proj/
up_proj/down_proj`, Qwen) under `block_sparse_moe` (Mixtral) or `mlp`; loading stacks
them into the block's w13 / w2 and, under tensor parallelism, reads this rank's rows
of w1/w3 and columns of w2 alone, as the dense MLP's. FP8 experts' `weight_scale`s (per
channel or per tensor, broadcast to rows) go to w13_scale / w2_scale the same way: a
rank's rows of w1/w3's, w2's whole.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from radixserve.engine.distributed import SINGLE, TPGroup
from radixserve.engine.kernels.norm import fused_add_rms_norm
from radixserve.engine.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)
from radixserve.engine.model.moe import MoEConfig, SparseMoEBlock
from radixserve.engine.model.quantization import EXPERT_SCALE, copy_weight_scale
from radixserve.engine.model.weights import StoredTensor
from radixserve.model_files.config import ModelConfig

# A checkpoint expert's projection: (prefix, expert, projection).
_EXPERT = re.compile(
    r"(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_scale)"
)
# The block's other parts, under either checkpoint name -> ours (`moe`).
_BLOCK = re.compile(r"\.(?:mlp|block_sparse_moe)\.(gate|shared_expert|shared_expert_gate)\.")
# w13's halves: the gate rows (0), then the up rows (1).
_W13_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
# Our stacked parameters per expert shard: w13 (and its scale) two, w2 one.
_STACKED = {
    ".moe.w13": 2,
    ".moe.w2": 1,
    f".moe.w13{EXPERT_SCALE}": 2,
    f".moe.w2{EXPERT_SCALE}": 1,
}


class MoEDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose MLP is the sparse block (`moe`): the norms, attention and
    pre_attention are Llama's; post_attention runs the block after the norm."""

    def __init__(
        self, config: ModelConfig, moe: MoEConfig, layer_id: int, tp: TPGroup = SINGLE
    ) -> None:
        # Llama's __init__ would also build the dense MLP this layer has not: its other
        # parts are built here.
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = SparseMoEBlock(config, moe, tp)

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.self_attn.project_out(out)
        norm = self.post_attention_layernorm
        normed, residual = fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.moe(normed), residual


class MoEForCausalLM(LlamaForCausalLM):
    """Build on the meta device (load_model does), then `init_rotary` and `load_weights`."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        # Llama's model without its (dense) layers, then this config's: dense or sparse.
        super().__init__(dataclasses.replace(config, num_hidden_layers=0), tp)
        self.config = config
        self.moe_config = MoEConfig.of(config)
        self.model.layers = nn.ModuleList(
            MoEDecoderLayer(config, self.moe_config, i, tp)
            if i in self.moe_config.sparse_layers
            else LlamaDecoderLayer(config, i, tp)
            for i in range(config.num_hidden_layers)
        )

    @staticmethod
    def _target_of(name: str) -> tuple[str, int]:
        """As Llama's, and an expert's projection -> (w13, 2 * expert + half) or (w2,
        expert); its FP8 scale the same shard of w13_scale / w2_scale."""
        expert = _EXPERT.fullmatch(name)
        if expert is None:
            return LlamaForCausalLM._target_of(_BLOCK.sub(r".moe.\1.", name))
        prefix, index, proj, kind = expert.groups()
        block = prefix.rsplit(".", 1)[0] + ".moe"
        suffix = EXPERT_SCALE if kind == "weight_scale" else ""
        if proj in _W13_HALF:
            return f"{block}.w13{suffix}", 2 * int(index) + _W13_HALF[proj]
        return f"{block}.w2{suffix}", int(index)

    def _copy_shard(
        self, param: torch.Tensor, target: str, shard: int, stored: StoredTensor
    ) -> None:
        if not target.endswith(tuple(_STACKED)):
            super()._copy_shard(param, target, shard, stored)
            return
        leaf = target.rsplit(".", 1)[-1]
        gate_up = leaf.startswith("w13")
        expert = shard // 2 if gate_up else shard
        if expert >= param.shape[0]:
            raise ValueError(
                f"weight {stored.name!r} names expert {expert}; the config has {param.shape[0]}"
            )
        if leaf.endswith(EXPERT_SCALE):
            # One scale per output row: a rank's rows of w1/w3's, w2's (hidden rows) whole.
            if gate_up:
                half = param.shape[1] // 2
                dest = param[expert].narrow(0, (shard % 2) * half, half)
                copy_weight_scale(dest, stored, self.tp.rank, self.tp.size)
            else:
                copy_weight_scale(param[expert], stored, 0, 1)
            return
        rows = param.shape[1] // 2 if gate_up else param.shape[2]
        # w1/w3 are [n, hidden]: this rank's rows; w2 is [hidden, n]: its columns.
        dim = 0 if gate_up else 1
        full = rows * self.tp.size
        if stored.shape[dim] != full:
            raise ValueError(
                f"weight {stored.name!r} has shape {stored.shape}, expected {full} along dim {dim}"
            )
        tensor = stored.read_range(dim, self.tp.rank * rows, rows)
        dest = param[expert]
        if gate_up:
            dest = dest.narrow(0, (shard % 2) * rows, rows)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight {stored.name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)

    def _expected_shards(self) -> set[tuple[str, int]]:
        """Llama's, with each expert's w1, w3 and w2 (and their FP8 scales) apart."""
        expected = super()._expected_shards()
        for name, param in self.named_parameters():
            for suffix, per_expert in _STACKED.items():
                if name.endswith(suffix):
                    expected.discard((name, -1))
                    expected |= {(name, s) for s in range(param.shape[0] * per_expert)}
        return expected
