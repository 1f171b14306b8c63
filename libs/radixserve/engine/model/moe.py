"""The sparse mixture-of-experts MLP block of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router (replicated on every rank, so all ranks pick the same experts) picks each
token's top-k experts; the experts' stacked weights run through kernels/moe.fused_moe.
Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by a sigmoid gate.

Tensor parallelism as the dense MLP: every expert (and the shared expert) holds this
rank's share of its intermediate rows, so each rank's output is a partial sum and one
all-reduce sums experts and shared expert together (the gate scales a token's whole
row, which commutes with the sum).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.engine.distributed import SINGLE, TPGroup
from radixserve.engine.kernels.activation import silu_and_mul
from radixserve.engine.kernels.linear import linear
from radixserve.engine.kernels.moe import fused_moe, select_experts
from radixserve.engine.model.llama import LlamaMLP
from radixserve.engine.model.quantization import EXPERT_SCALE, expert_weight, weight_of
from radixserve.model_files.config import ModelConfig

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE fields of a config.json, named as radixserve uses them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1
    # Routing weights rounded to the model's dtype before they scale the experts (Qwen's
    # routers; Mixtral's stay float32), as Hugging Face rounds them.
    round_weights: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]  # the layers whose MLP is this block; the others dense

    @classmethod
    def of(cls, config: ModelConfig) -> MoEConfig:
        raw = config.raw
        layers = config.num_hidden_layers
        if config.architecture == "MixtralForCausalLM":
            return cls._checked(
                num_experts=_int(raw, "num_local_experts"),
                top_k=_int(raw, "num_experts_per_tok"),
                intermediate_size=config.intermediate_size,
                renormalize=True,
                round_weights=False,
                shared_expert_intermediate_size=0,
                sparse_layers=frozenset(range(layers)),
            )
        if config.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"{config.architecture} is not a mixture-of-experts model")
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        if experts is None:
            raise ValueError("config.json lacks 'num_experts'")
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        shared = (
            _int(raw, "shared_expert_intermediate_size")
            if config.architecture == "Qwen2MoeForCausalLM"
            else 0
        )
        return cls._checked(
            num_experts=int(experts),
            top_k=_int(raw, "num_experts_per_tok"),
            intermediate_size=_int(raw, "moe_intermediate_size"),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            round_weights=True,
            shared_expert_intermediate_size=shared,
            # Hugging Face's rule (Qwen2MoeDecoderLayer): every step-th layer, less mlp_only_layers.
            sparse_layers=frozenset(
                i
                for i in range(layers)
                if i not in dense and int(experts) > 0 and step > 0 and (i + 1) % step == 0
            ),
        )

    @classmethod
    def _checked(cls, **fields: Any) -> MoEConfig:
        moe = cls(**fields)
        if moe.sparse_layers and not 0 < moe.top_k <= moe.num_experts:
            raise ValueError(
                f"num_experts_per_tok {moe.top_k} must be in 1..num_experts ({moe.num_experts})"
            )
        return moe


def _int(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return int(raw[key])


class SparseMoEBlock(nn.Module):
    """Router `gate` [experts, hidden]; experts' `w13` [experts, 2 * n, hidden] (gate rows
    then up rows) and `w2` [experts, hidden, n], n this rank's share of each expert's
    intermediate rows; with FP8 experts (model/quantization.py) w13 / w2 hold e4m3 codes
    and `w13_scale` [experts, 2 * n] / `w2_scale` [experts, hidden] their float32 row
    scales (None while 16-bit). With a shared expert, `shared_expert` (a dense MLP's
    parameters) and its gate `shared_expert_gate` [1, hidden]."""

    w13_scale: nn.Parameter | None
    w2_scale: nn.Parameter | None

    def __init__(self, config: ModelConfig, moe: MoEConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.routing = moe
        self.intermediate_size = tp.split(moe.intermediate_size, "expert MLP rows")
        hidden = config.hidden_size
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * self.intermediate_size, hidden))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden, self.intermediate_size))
        self.register_parameter("w13" + EXPERT_SCALE, None)
        self.register_parameter("w2" + EXPERT_SCALE, None)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                config, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False
            )
            self.shared_expert = LlamaMLP(shared, tp)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for the normed tokens x [tokens, hidden], summed over the ranks."""
        logits = linear(x, self.gate.weight, None)
        weight_dtype = x.dtype if self.routing.round_weights else torch.float32
        weights, ids = select_experts(
            logits, self.routing.top_k, self.routing.renormalize, weight_dtype
        )
        w13, w2 = expert_weight(self, "w13"), expert_weight(self, "w2")
        out = fused_moe(x, w13, w2, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            mlp = self.shared_expert
            act = silu_and_mul(linear(x, weight_of(mlp.gate_up_proj), None))
            shared = linear(act, weight_of(mlp.down_proj), None)
            gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight, None))
            out = out + gate * shared
        return self.tp.all_reduce(out)
