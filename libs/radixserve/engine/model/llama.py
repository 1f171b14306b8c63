"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 dense).

Works on the flattened tokens of a `ForwardBatch`; attention goes through the
backend seam, which owns the KV cache. The op order of each block follows Hugging
Face's implementation so float32 logits match it to ~1e-5. The elementwise ops
(engine/kernels) run as fused Triton kernels on CUDA and as Hugging Face's torch ops
elsewhere. Layers carry the residual stream apart from their output, so each
RMSNorm fuses the residual add before it (the final norm included), and runs with the
projection after it (kernels/linear.py): at one token on CUDA norm, SiLU x mul and
projection are one GEMV kernel.

Tensor parallelism (`tp`, engine/distributed.py) as in Megatron: each rank holds its
share of the query and KV heads (qkv_proj's rows) and of the MLP's intermediate rows
(gate_up_proj), and the matching columns of o_proj and down_proj, whose partial outputs
are summed over the ranks. Where the ranks divide the vocabulary, the embeddings and
the head are vocabulary-parallel: each rank holds its rows of the embeddings (a lookup
zeroes the ids outside them and an all-reduce sums the ranks' partial embeddings) and
computes the logits of its rows of the head (a tied head: its rows of the embeddings,
the same storage), and an all-gather puts them side by side, so every rank holds the same
logits and reads 1/tp of the head a step. Elsewhere both are whole on every rank, as the
norms always are.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.engine.distributed import SINGLE, TPGroup
from radixserve.engine.kernels.linear import add_norm_linear, linear
from radixserve.engine.kernels.norm import rms_norm
from radixserve.engine.kernels.rotary import Rotation, apply_rotary_and_store
from radixserve.engine.model.quantization import (
    WEIGHT_SCALE,
    checkpoint_name,
    copy_weight_scale,
    weight_of,
)
from radixserve.engine.model.rope import RotaryTable
from radixserve.engine.model.weights import StoredTensor, iter_safetensors
from radixserve.model_files.config import ModelConfig

if TYPE_CHECKING:
    from radixserve.engine.attention.base import AttentionBackend
    from radixserve.engine.forward_batch import ForwardBatch
    from radixserve.engine.kvcache.pool import KVPool

# Prompt logprobs: rows scored per head pass (bounds the float32 logits held at once).
SCORE_ROWS_PER_PASS = 512
# Checkpoint projection -> (our fused parameter, shard index within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) (Qwen3's q/k norms; the block norms run with the projection after them,
        kernels/linear.add_norm_linear)."""
        return rms_norm(x, self.weight, self.eps)


def vocab_shard_rows(vocab_size: int, tp: TPGroup) -> int | None:
    """Each rank's rows of the embeddings and of the head: vocab / tp where the ranks
    divide the vocabulary, else None (whole on every rank)."""
    if tp.size > 1 and vocab_size % tp.size == 0:
        return vocab_size // tp.size
    return None


class VocabParallelEmbedding(nn.Module):
    """The token embeddings, as Megatron's VocabParallelEmbedding: with `shard_rows`, this
    rank holds rows [rank * shard_rows, (rank + 1) * shard_rows) of the table; a lookup
    gives the rows of its own ids, zeros for the others', and the all-reduce sums the
    ranks' parts (exact: each row is one rank's value plus zeros). Without, the whole
    table, looked up locally."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.shard_rows = vocab_shard_rows(vocab_size, tp)
        self.first_row = tp.rank * (self.shard_rows or 0)
        self.weight = nn.Parameter(torch.empty(self.shard_rows or vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard_rows is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.shard_rows)
        # Another rank's ids look up row 0 (a valid index) and are zeroed after.
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.split(config.num_key_value_heads, "KV heads")
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def rotate_and_store(
        self, qkv: torch.Tensor, rotation: Rotation, kv_pool: KVPool, loc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, k, v, stored) from the qkv projection's output ([tokens, q + 2 kv]): q and k
        normed (Qwen3) and rotated. On the Triton path the rotary kernel also stores the
        new K/V at `loc` (stored True: one launch fewer); else attention stores them."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.shard_sizes(), dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, stored = apply_rotary_and_store(
            q, k, rotation, kv_pool.kv_write(self.layer_id, loc, v)
        )
        return q, k, v, stored

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        stored: bool,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Attention through the backend: [tokens, q_size]."""
        out = attn.forward(q, k, v, self.layer_id, batch, self.scale, kv_stored=stored)
        return out.reshape(q.shape[0], self.q_size)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj over the attention's output, summed over the ranks."""
        return self.tp.all_reduce(linear(out, weight_of(self.o_proj), self.o_proj.bias))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.split(config.intermediate_size, "MLP rows")
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, act: torch.Tensor) -> torch.Tensor:
        """down_proj over silu(gate) * up (the gate_up projection's, with the norm before
        it: LlamaDecoderLayer.post_attention), summed over the ranks."""
        return self.tp.all_reduce(linear(act, weight_of(self.down_proj), self.down_proj.bias))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it); the stream is hidden + residual,
        or the embeddings alone at the first layer (residual None). The parts before and
        after attention are apart so that graphs can hold them (graphs/piecewise.py)."""
        q, k, v, stored, residual = self.pre_attention(
            hidden, residual, rotation, batch.kv_pool, batch.out_cache_loc
        )
        out = self.self_attn.attend(q, k, v, stored, batch, attn)
        return self.post_attention(out, residual)

    def pre_attention(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        kv_pool: KVPool,
        loc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.Tensor]:
        """(q, k, v, stored, residual stream): the input norm with the residual add, the
        qkv projection, rotary (and the K/V store at `loc` where the kernel does it).
        Each norm runs with the projection after it (kernels/linear.py: one kernel at
        one token)."""
        norm, proj = self.input_layernorm, self.self_attn.qkv_proj
        qkv, residual = add_norm_linear(
            hidden, residual, norm.weight, norm.eps, weight_of(proj), proj.bias
        )
        return (*self.self_attn.rotate_and_store(qkv, rotation, kv_pool, loc), residual)

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) from the attention's output [tokens, q_size]."""
        hidden = self.self_attn.project_out(out)
        norm, proj = self.post_attention_layernorm, self.mlp.gate_up_proj
        act, residual = add_norm_linear(
            hidden, residual, norm.weight, norm.eps, weight_of(proj), proj.bias, gated=True
        )
        return self.mlp(act), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Build on any device (meta included), then `init_rotary` and `load_weights` before use."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        # Each rank's rows of the head, the embeddings' (None: the whole head on every rank).
        self.head_rows = self.model.embed_tokens.shard_rows
        self.lm_head = nn.Linear(
            config.hidden_size, self.head_rows or config.vocab_size, bias=False
        )
        self.rotary: RotaryTable | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        # Moving a module off the meta device gives every module its own tensor again. A
        # tied head's rows are this rank's embeddings (vocab_shard_rows: the same rows).
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rotary(self, max_positions: int | None = None) -> None:
        """Build the cos/sin table on the weights' device and in their dtype."""
        weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(
            self.config,
            max_positions or self.config.max_position_embeddings,
            weight.dtype,
            weight.device,
        )

    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [batch_size, vocab] at each request's last new token, in the model's dtype
        (what the head computes: a float32 copy would cost a pass over them that greedy
        rows never need; the sampler widens them where it computes on them), written
        into `logits_out` when given (the CUDA graphs' one shared output buffer)."""
        rotation = self.rotation(batch.positions)
        hidden = self.model.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, rotation, batch, attn)
        return self.finish(hidden, residual, batch, logits_out)

    def rotation(self, positions: torch.Tensor) -> Rotation:
        """The rotary input of a pass over tokens at `positions`."""
        if self.rotary is None:
            raise RuntimeError("call init_rotary() (load_model does) before the first forward")
        return Rotation.of(self.rotary, positions)

    def finish(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """After the last layer: the prompt logprobs a batch asks for, then the logits
        (forward's)."""
        if batch.logprob_rows is not None:
            batch.input_logprobs = self._score_rows(hidden, residual, batch)
        # The last add, norm and head only where logits are needed: per-token ops, so
        # this is exact.
        return self._head(hidden, residual, batch.last_token_indices, logits_out)

    def _head(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last residual add, the final norm and the head at `rows` of the tokens."""
        norm = self.model.norm
        shards = self.head_rows
        logits, _ = add_norm_linear(
            hidden[rows],
            None if residual is None else residual[rows],
            norm.weight,
            norm.eps,
            self.lm_head.weight,
            None,
            out=out if shards is None else None,
        )
        if shards is None:
            return logits
        # [tp, rows, vocab / tp] -> [rows, vocab]: rank r's logits are columns r * shards..
        gathered = self.tp.all_gather(logits).permute(1, 0, 2)
        if out is None:
            return gathered.reshape(logits.shape[0], self.config.vocab_size)
        out.view(logits.shape[0], self.tp.size, shards).copy_(gathered)
        return out

    def _score_rows(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Prompt logprobs: at each of `batch.logprob_rows`, the float32 log-softmax of the
        head's logits at the token it scores (and the top `logprob_top`), a few hundred
        rows at a time (a whole chunk's logits at once would be chunk x vocab floats)."""
        rows, targets, k = batch.logprob_rows, batch.logprob_targets, batch.logprob_top
        assert rows is not None and targets is not None
        chosen, top_ids, top_values = [], [], []
        for start in range(0, rows.numel(), SCORE_ROWS_PER_PASS):
            logits = self._head(hidden, residual, rows[start : start + SCORE_ROWS_PER_PASS])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            wanted = targets[start : start + SCORE_ROWS_PER_PASS].unsqueeze(1)
            chosen.append(logprobs.gather(1, wanted).squeeze(1))
            if k > 0:
                values, ids = logprobs.topk(k, dim=-1)
                top_ids.append(ids)
                top_values.append(values)
        if k == 0:
            return torch.cat(chosen), None, None
        return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_values)

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        """Copy a Hugging Face checkpoint into the (possibly fused) parameters; strict both ways."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self._expected_shards()
        loaded: set[tuple[str, int]] = set()
        for stored in iter_safetensors(path):
            name = checkpoint_name(stored.name)  # FP8 scales (model/quantization.py)
            if name is None or name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, not a weight
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy
            target, shard = self._target_of(name)
            if target not in params:
                raise ValueError(
                    f"unexpected weight {name!r} in {path} for {self.config.architecture}"
                )
            self._copy_shard(params[target], target, shard, stored)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s >= 0 else n for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint {path} lacks {len(missing)} weights: {shown}")

    @staticmethod
    def _target_of(name: str) -> tuple[str, int]:
        """(our parameter name, shard index or -1 for an unfused parameter)."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
        return name, -1

    def _shard_rows(self, target: str, shard: int) -> tuple[int, int]:
        module = self.get_submodule(target.rsplit(".", 2)[0])
        if not isinstance(module, LlamaAttention | LlamaMLP):
            raise ValueError(f"{target} is not a fused projection")
        sizes = module.shard_sizes()
        start = sum(sizes[:shard])
        return start, sizes[shard]

    def _rank_slice(self, target: str, shard: int, stored: StoredTensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor, read alone: rows of q/k/v and gate/up
        (weights and biases), columns of o_proj and down_proj; their biases on rank 0 only
        (added once to the summed output); rows of vocabulary-parallel embeddings and of
        an untied head; everything else whole."""
        tp = self.tp
        if tp.size == 1:
            return stored.read()
        embed = self.model.embed_tokens
        vocab_parallel = target in ("model.embed_tokens.weight", "lm_head.weight")
        if vocab_parallel and embed.shard_rows is not None:
            if stored.shape[0] != self.config.vocab_size:  # a rank's rows would hide it
                raise ValueError(
                    f"weight {stored.name!r} has {stored.shape[0]} rows, "
                    f"expected the vocabulary's {self.config.vocab_size}"
                )
            return stored.read_range(0, embed.first_row, embed.shard_rows)
        leaf = target.rsplit(".", 2)[-2]
        if shard >= 0:  # a fused projection's q, k, v, gate or up
            rows = stored.shape[0] // tp.size
            return stored.read_range(0, tp.rank * rows, rows)
        if leaf in ("o_proj", "down_proj"):
            if target.endswith(".bias"):
                bias = stored.read()
                return bias if tp.rank == 0 else torch.zeros_like(bias)
            cols = stored.shape[1] // tp.size
            return stored.read_range(1, tp.rank * cols, cols)
        return stored.read()

    def _copy_shard(
        self, param: torch.Tensor, target: str, shard: int, stored: StoredTensor
    ) -> None:
        if target.endswith(WEIGHT_SCALE):
            # An FP8 projection's scale per output row: a fused part's split over the
            # ranks as its rows are; o_proj's and down_proj's whole.
            fused = shard >= 0
            start, rows = self._shard_rows(target, shard) if fused else (0, param.shape[0])
            rank, ranks = (self.tp.rank, self.tp.size) if fused else (0, 1)
            copy_weight_scale(param.narrow(0, start, rows), stored, rank, ranks)
            return
        tensor = self._rank_slice(target, shard, stored)
        dest = param
        if shard >= 0:
            start, rows = self._shard_rows(target, shard)
            dest = param.narrow(0, start, rows)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight {stored.name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)

    def _expected_shards(self) -> set[tuple[str, int]]:
        expected: set[tuple[str, int]] = set()
        for name, _ in self.named_parameters():  # duplicates (tied head) removed
            leaf = name.rsplit(".", 2)[-2]
            if leaf == "qkv_proj":
                expected |= {(name, 0), (name, 1), (name, 2)}
            elif leaf == "gate_up_proj":
                expected |= {(name, 0), (name, 1)}
            else:
                expected.add((name, -1))
        return expected
