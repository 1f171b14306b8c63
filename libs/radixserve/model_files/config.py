"""`ModelConfig`: the parts of a Hugging Face config.json the Llama-family model needs.

Reads both the transformers < 5 spelling (`rope_theta`, `rope_scaling`) and the
transformers 5 one (`rope_parameters`), and merges eos ids from config.json and
generation_config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures that share the Llama decoder block; the differences are flags below.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    # Mixture-of-experts MLPs on the same attention (engine/model/moe.py reads their fields).
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    # Sandwich norms, GeGLU, soft-caps, local/global layers (engine/model/gemma.py).
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# RoPE types whose frequencies do not depend on the running sequence length, so one
# cos/sin table serves every position (`dynamic` and `longrope` would not).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # The full rope parameter dict (rope_type, factor, ...) when scaling is used, else None.
    rope_scaling: dict[str, Any] | None
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 when attention_bias; never Qwen2
    mlp_bias: bool
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # "bfloat16" etc., as config.json names it
    # Per layer: the sliding window (keys a query sees, its own included) or None for
    # full attention, as transformers assigns them (layer_types, max_window_layers).
    layer_windows: tuple[int | None, ...]
    # Gemma 2's attention logit soft-cap (scores -> cap * tanh(score / cap)), else None.
    attn_soft_cap: float | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def sliding_window(self) -> int | None:
        """The window of the layers that have one (None: every layer attends in full)."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        raw = json.loads(config_file.read_text())
        gen_file = folder / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture = _pick_architecture(raw)
        gemma = architecture in GEMMA_ARCHITECTURES
        # Gemma's activation is hidden_activation (its hidden_act is a legacy copy).
        act = raw.get("hidden_activation") if gemma else None
        act = act or raw.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        supported_act = "gelu_pytorch_tanh" if gemma else "silu"
        if act != supported_act:
            raise ValueError(f"hidden_act {act!r} is not supported (only {supported_act!r})")
        hidden = int(_require(raw, "hidden_size"))
        heads = int(_require(raw, "num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _parse_rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(_require(raw, "intermediate_size")),
            num_hidden_layers=int(_require(raw, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            vocab_size=int(_require(raw, "vocab_size")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            layer_windows=_layer_windows(raw, architecture),
            attn_soft_cap=_attn_soft_cap(raw, architecture),
            raw=raw,
        )


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return raw[key]


def _pick_architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ValueError(
        f"unsupported model architecture {archs or '(none given)'}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the old or the transformers-5 layout."""
    params = dict(raw.get("rope_parameters") or {})
    # Gemma 3 gives each layer type its own; the local layers' theta: engine/model/gemma.py.
    params = dict(params.get("full_attention", params))
    legacy = raw.get("rope_scaling") or {}
    merged: dict[str, Any] = {**legacy, **params}
    theta = merged.pop("rope_theta", raw.get("rope_theta", 10000.0))
    # Old configs spell the type "type"; "default" and "none" mean no scaling.
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, "rope_theta": float(theta), **merged}


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        values = source if isinstance(source, list) else [source]
        for value in values:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def _attn_soft_cap(raw: dict[str, Any], architecture: str) -> float | None:
    """Gemma's attention logit soft-cap (transformers' default: 50 for Gemma 2, none for 3)."""
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    cap = raw.get("attn_logit_softcapping", 50.0 if architecture == "Gemma2ForCausalLM" else None)
    return None if cap is None else float(cap)


def _layer_windows(raw: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's window, as transformers' config classes assign them: Mistral and
    Mixtral on every layer; Qwen2/Qwen3 only with use_sliding_window, on the layers from
    max_window_layers on; Gemma 2 on every other layer, Gemma 3 on all but every
    sliding_window_pattern-th (6); an explicit layer_types list wins for those."""
    layers = int(_require(raw, "num_hidden_layers"))
    window = raw.get("sliding_window")
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if raw.get("use_sliding_window"):
            raise ValueError(f"sliding-window attention of {architecture} is not supported")
        return (None,) * layers
    if window is None or architecture == "LlamaForCausalLM":
        return (None,) * layers
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (int(window),) * layers
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
        "use_sliding_window"
    ):
        return (None,) * layers
    kinds = raw.get("layer_types")
    if kinds is None:
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = int(raw.get("max_window_layers", 28))
            sliding = [i >= first for i in range(layers)]
        else:
            pattern = raw.get("sliding_window_pattern") or 6  # Gemma 3's default
            every = 2 if architecture == "Gemma2ForCausalLM" else int(pattern)
            sliding = [(i + 1) % every != 0 for i in range(layers)]
    else:
        if len(kinds) != layers:
            raise ValueError(f"layer_types names {len(kinds)} layers; the model has {layers}")
        sliding = [kind == "sliding_attention" for kind in kinds]
    return tuple(int(window) if s else None for s in sliding)
