"""The floor of an offline run: the least time its work takes at the device's measured
matmul rate and copy bandwidth, so a throughput can be read as a share of its roofline.

The work of a Llama-shaped model, request by request:

- its projections (q, k, v, o, gate, up, down in every layer) over each token it
  computes: the prompt tokens the cache did not hold, and one token per decode step
  (every output token but the first, which the prefill samples); the LM head over each
  sampled token. 2 FLOPs per weight per token, at the matmul rate. Given the tokens each
  engine step computed, a step's projections take at least the time to read their
  weights at the copy bandwidth too: a batch of fewer than a few hundred rows is bound
  by that read, not by its FLOPs (the head's weights are left out of that bound);
- prefill attention: each computed prompt token attends over every position up to its
  own (4 x head_dim FLOPs per query head, layer and key), at the matmul rate;
- decode attention: each decode step reads the K and V of every position before it, at
  the copy bandwidth. A prefix that `sharers` requests decode over together (cascade
  attention over a radix-cache path) is read once for all of them: each is charged
  1 / sharers of it.

The parts are added, not overlapped: the engine runs them one after another (a layer's
attention between its projections), so this is the floor of its way of running a step,
not of the device. Norms, activations and rotary are left out (fusable), as are the KV
writes (a small share of the reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model_files.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def of_model(cls, config: ModelConfig, dtype: torch.dtype) -> ModelShape:
        """A loaded model's (`Engine.runner.model_config`, `.dtype`)."""
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab=config.vocab_size,
            dtype_bytes=dtype.itemsize,
        )

    @property
    def layer_params(self) -> int:
        """Weights of the projections of all layers (embedding and LM head excluded)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position over all layers."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.layers


@dataclass(frozen=True)
class RequestWork:
    prompt_len: int
    cached_len: int  # prompt tokens found in the cache (not computed)
    output_len: int
    shared_len: int = 0  # leading positions read once for `sharers` requests in decode
    sharers: int = 1


@dataclass(frozen=True)
class Floor:
    projections_s: float
    prefill_attention_s: float
    decode_attention_s: float

    @property
    def total_s(self) -> float:
        return self.projections_s + self.prefill_attention_s + self.decode_attention_s


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when hi < lo)."""
    return 0 if hi < lo else (lo + hi) * (hi - lo + 1) // 2


def work_floor(
    shape: ModelShape,
    requests: list[RequestWork],
    matmul_rate: float,
    bandwidth: float,
    step_tokens: list[int] | None = None,
) -> Floor:
    """The floor of running `requests` (rates in FLOP/s and bytes/s); with `step_tokens`
    (the tokens each engine step computed), each step's layer projections are bound by
    their weight read as well as their FLOPs."""
    projection_flops = attention_flops = 0
    kv_bytes = 0.0
    per_key = 4 * shape.head_dim * shape.heads * shape.layers  # QK^T and PV, every head
    for r in requests:
        computed = r.prompt_len - r.cached_len
        decode_steps = max(r.output_len - 1, 0)
        projection_flops += 2 * shape.layer_params * (computed + decode_steps)
        projection_flops += 2 * shape.hidden * shape.vocab * min(r.output_len, 1 + decode_steps)
        # Prompt position p (0-based) attends over p + 1 keys.
        attention_flops += per_key * _sum_range(r.cached_len + 1, r.prompt_len)
        # Decode step t computes position prompt_len + t over prompt_len + t + 1 keys.
        keys = _sum_range(r.prompt_len + 1, r.prompt_len + decode_steps)
        shared = min(r.shared_len, r.prompt_len)
        keys -= decode_steps * shared * (1 - 1 / max(r.sharers, 1))
        kv_bytes += keys * shape.kv_bytes_per_token
    projections_s = projection_flops / matmul_rate
    if step_tokens is not None:
        # A step of n tokens takes max(n x FLOPs a token, weight read): the read's excess
        # over the step's FLOPs comes on top. (Steps may compute more than the requests'
        # tokens, after a retraction or for a request aborted: the bound still holds.)
        per_token = 2 * shape.layer_params / matmul_rate
        weights = shape.layer_params * shape.dtype_bytes / bandwidth
        projections_s += sum(max(weights - n * per_token, 0.0) for n in step_tokens if n)
    return Floor(
        projections_s=projections_s,
        prefill_attention_s=attention_flops / matmul_rate,
        decode_attention_s=kv_bytes / bandwidth,
    )
