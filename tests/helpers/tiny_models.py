"""Tiny random-weight models in Hugging Face format, with the real SmolLM2 tokenizer.

They exercise every code path of the real architectures (GQA, tied or untied head,
q/k norm, biases, rope scaling) in milliseconds. Weights are drawn larger than
transformers' init so logits differ by whole units between positions: a wrong
mask or a wrong rotation shows up far above the test tolerances.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA, 2 query heads per KV head
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
}


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted from GGUF (cached after the first call)."""
    from radixserve.model_files.paths import resolve_model_path

    return resolve_model_path(None)


def make_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Llama with an untied head. `overrides` go to LlamaConfig (e.g. rope_scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_base_fields(), "tie_word_embeddings": False, **overrides})
    return _build(LlamaForCausalLM, config, Path(out_dir), seed)


def make_tiny_qwen3(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen3 (q/k norm) with a tied head and q/k/v/o biases."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {"attention_bias": True, **overrides}
    config = Qwen3Config(**{**_base_fields(), "tie_word_embeddings": True, **fields})
    return _build(Qwen3ForCausalLM, config, Path(out_dir), seed)


def make_tiny_qwen2(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen2 (q/k/v bias, no o bias) with a tied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**_base_fields(), "tie_word_embeddings": True, **overrides})
    return _build(Qwen2ForCausalLM, config, Path(out_dir), seed)


def make_tiny_mixtral(out_dir: Path, seed: int = 0) -> Path:
    """Mixtral: top-2 of 8 experts on every layer, untied head."""
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = {"num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    return _build(MixtralForCausalLM, MixtralConfig(**{**_base_fields(), **fields}), out_dir, seed)


def make_tiny_qwen2_moe(out_dir: Path, seed: int = 0) -> Path:
    """Qwen2-MoE: top-3 of 6 experts unnormalised, a shared expert with its gate, layer 1
    dense (mlp_only_layers), q/k/v biases, tied head."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    fields = {
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
        "tie_word_embeddings": True,
    }
    config = Qwen2MoeConfig(**{**_base_fields(), **fields})
    return _build(Qwen2MoeForCausalLM, config, out_dir, seed)


def make_tiny_qwen3_moe(out_dir: Path, seed: int = 0) -> Path:
    """Qwen3-MoE: top-4 of 8 experts renormalised (norm_topk_prob), every second layer
    sparse (decoder_sparse_step 2), q/k norms, untied head."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {
        "num_experts": 8,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": False,
    }
    config = Qwen3MoeConfig(**{**_base_fields(), **fields})
    return _build(Qwen3MoeForCausalLM, config, out_dir, seed)


def _base_fields() -> dict[str, Any]:
    tokenizer = _smollm2_tokenizer()
    return {
        **TINY_SHAPE,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
    }


def _build(model_cls: Any, config: Any, out_dir: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _smollm2_tokenizer().save_pretrained(out_dir)
    return out_dir


_TOKENIZER: Any = None


def _smollm2_tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        from radixserve.model_files.tokenizer import load_tokenizer

        # A machine without the embedded GGUF (a lent GPU) can point at copied tokenizer files.
        source = os.environ.get("RADIXSERVE_TEST_TOKENIZER_DIR")
        _TOKENIZER = load_tokenizer(Path(source) if source else embedded_model_dir())
    return _TOKENIZER


# Sliding windows shorter than the test prompts (~40 tokens), so the window decides
# which keys a query sees on most positions.
TINY_WINDOW = 8


def make_tiny_mistral(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Mistral v0.1: a sliding window on every layer, untied head. `overrides` (here and
    below) go to the config, e.g. head_dim for FlashInfer's kernels."""
    from transformers import MistralConfig, MistralForCausalLM

    fields = {"sliding_window": TINY_WINDOW, "tie_word_embeddings": False, **overrides}
    return _build(MistralForCausalLM, MistralConfig(**{**_base_fields(), **fields}), out_dir, seed)


def make_tiny_qwen2_window(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen2 with use_sliding_window: layers from max_window_layers (1) on are windowed."""
    fields = {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1}
    return make_tiny_qwen2(out_dir, seed, **{**fields, **overrides})


def make_tiny_gemma2(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Gemma 2: windowed layers 0 and 2, full layer 1; attention and final soft-caps small
    enough that they bend the random model's scores; query_pre_attn_scalar apart from
    head_dim; tied head."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    fields = {
        "sliding_window": TINY_WINDOW,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 6.0,
        "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        **overrides,
    }
    return _build(Gemma2ForCausalLM, Gemma2Config(**{**_base_fields(), **fields}), out_dir, seed)


def make_tiny_gemma3(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Gemma 3 text: windowed layers 0 and 2 (their rope base 10k), full layer 1 (1M),
    q/k norms, no soft-caps; tied head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fields = {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
        **overrides,
    }
    config = Gemma3TextConfig(**{**_base_fields(), **fields})
    return _build(Gemma3ForCausalLM, config, out_dir, seed)
