"""Rotary position embeddings: inverse frequencies and the cos/sin table (kernels/rotary.py
applies it).

The table is indexed by absolute position, so a request's tokens get the same
rotation whether they arrive in one prefill, in chunks, or one by one in decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model_files.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32 on the CPU, attention scaling of cos/sin)."""
    if config.rope_scaling is None:
        dim = config.head_dim
        # Same expression as transformers' default RoPE, for bit-exact parity.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    return _transformers_inv_freq(config)


def _transformers_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    # Scaled variants (linear, llama3, yarn) reuse transformers' own functions, so the
    # frequencies match the reference implementation exactly, version for version.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init_fn = ROPE_INIT_FUNCTIONS.get(config.rope_type)
    if init_fn is None:
        raise ValueError(f"this transformers version has no rope type {config.rope_type!r}")
    fields = {k: v for k, v in config.raw.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config.model_type, **fields)
    # Gemma 3 nests its parameters per layer type: these are its global layers'.
    nested = "full_attention" in (getattr(hf_config, "rope_parameters", None) or {})
    layer_type = {"layer_type": "full_attention"} if nested else {}
    inv_freq, attention_scaling = init_fn(hf_config, torch.device("cpu"), **layer_type)
    return inv_freq.float(), float(attention_scaling)


class RotaryTable:
    """cos/sin of every position up to `max_positions`, in the model's dtype on its device."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq, scaling = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 then cast, as transformers does before applying them.
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
