"""Sliding-window attention and Gemma 2/3: per-layer windows as transformers assigns
them; the torch reference's windowed, soft-capped attention against transformers' own
mask functions and eager op order; greedy tokens of tiny random Mistral (window on every
layer), Qwen2 (use_sliding_window), Gemma 2 and Gemma 3 through the engine equal to
transformers' eager generate (float32, CPU), also through the radix cache over a shared
prefix longer than the window and in small prefill chunks; a backend without windows
refuses such a model at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.engine.attention.base import (
    FULL_ATTENTION,
    LayerAttention,
    layer_attention,
)
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.gemma import GemmaDecoderLayer, GemmaForCausalLM, ScaledEmbedding
from radixserve.engine.model.loader import load_model
from radixserve.model_files.config import ModelConfig
from tests.helpers import attention_passes
from tests.helpers.tiny_models import (
    TINY_WINDOW,
    make_tiny_gemma2,
    make_tiny_gemma3,
    make_tiny_mistral,
    make_tiny_qwen2_window,
)
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    greedy_params,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
BUILDERS = {
    "mistral": make_tiny_mistral,
    "qwen2": make_tiny_qwen2_window,
    "gemma2": make_tiny_gemma2,
    "gemma3": make_tiny_gemma3,
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_windowed")
    return {name: build(root / name, seed=11) for name, build in BUILDERS.items()}


# -- which layers have a window: transformers' own assignment ------------------------
def _hf_windows(arch: str, fields: dict[str, Any]) -> list[int | None]:
    """Each layer's window as transformers' model reads it: the attention module's
    sliding_window where it keeps one (Qwen2, Gemma), else the config's on every layer
    (Mistral's mask)."""
    import transformers

    config_class = {
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    }[arch]
    config = config_class(**fields)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    return [
        getattr(layer.self_attn, "sliding_window", config.sliding_window)
        for layer in model.model.layers
    ]


SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 128,
    "num_hidden_layers": 8,
}


@pytest.mark.parametrize(
    "arch,fields",
    [
        ("MistralForCausalLM", {"sliding_window": 16}),
        ("MistralForCausalLM", {"sliding_window": None}),
        ("Qwen2ForCausalLM", {"sliding_window": 16, "use_sliding_window": False}),
        ("Qwen2ForCausalLM", {"sliding_window": 16, "use_sliding_window": True}),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 5},
        ),
        ("Gemma2ForCausalLM", {"sliding_window": 16}),
        ("Gemma3ForCausalLM", {"sliding_window": 16}),  # pattern 6: layer 5 global
        ("Gemma3ForCausalLM", {"sliding_window": 16, "sliding_window_pattern": 3}),
        (
            "Gemma3ForCausalLM",
            {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"] * 4},
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_layer_windows_follow_transformers(arch: str, fields: dict[str, Any]) -> None:
    raw = {"architectures": [arch], **SMALL, **fields}
    ours = ModelConfig.from_dict(raw).layer_windows
    assert list(ours) == _hf_windows(arch, {**SMALL, **fields})


def test_moe_windows_are_refused_not_ignored() -> None:
    raw = {"architectures": ["Qwen2MoeForCausalLM"], **SMALL, "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window attention of Qwen2MoeForCausalLM"):
        ModelConfig.from_dict({**raw, "sliding_window": 16})


# -- the torch reference against transformers' mask and eager attention ----------------
def _eager_reference(
    p: attention_passes.Pass, layer_id: int, scale: float, layer: LayerAttention
) -> torch.Tensor:
    """Per request, transformers' mask function over (query position, key position) and
    its eager attention (scores, soft-cap, mask, float32 softmax), over the pool's
    keys in sequence order."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    batch: ForwardBatch = p.batch
    mask_fn = (
        causal_mask_function
        if layer.window is None
        else sliding_window_causal_mask_function(layer.window)
    )
    k_buffer, v_buffer = batch.kv_pool.k_buffers[layer_id], batch.kv_pool.v_buffers[layer_id]
    group = p.q.shape[1] // k_buffer.shape[1]
    outs = []
    start = 0
    for b, (seq, prefix) in enumerate(
        zip(batch.seq_lens_cpu, batch.extend_prefix_lens_cpu, strict=True)
    ):
        new = seq - prefix
        slots = batch.req_to_token[int(batch.req_pool_indices[b]), :seq].long()
        keys = k_buffer[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq, d]
        values = v_buffer[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        q = p.q[start : start + new].transpose(0, 1)  # [H, new, d]
        # transformers' mask functions broadcast over index tensors (as under vmap).
        q_idx = torch.arange(prefix, seq)[:, None]
        allowed = mask_fn(0, 0, q_idx, torch.arange(seq)[None, :]).expand(new, seq)
        scores = q @ keys.transpose(1, 2) * scale
        if layer.soft_cap is not None:
            scores = torch.tanh(scores / layer.soft_cap) * layer.soft_cap
        scores = scores + torch.where(allowed, 0.0, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append((weights @ values).transpose(0, 1))
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize(
    "layer",
    [
        FULL_ATTENTION,
        LayerAttention(window=6),
        LayerAttention(soft_cap=1.5),
        LayerAttention(5, 2.0),
    ],
    ids=["full", "window", "soft_cap", "both"],
)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_torch_backend_matches_transformers_mask(layer: LayerAttention, mode: ForwardMode) -> None:
    # Prompts without and with a cached prefix, longer and shorter than the window, and
    # a decoding request (mixed batch) beside them.
    if mode == ForwardMode.EXTEND:
        prefix_lens, extend_lens = [0, 3, 20, 11], [19, 9, 7, 1]
    else:
        prefix_lens, extend_lens = [0, 4, 5, 30], [1, 1, 1, 1]
    p = attention_passes.make_pass(prefix_lens, extend_lens, device=torch.device("cpu"), mode=mode)
    backend = TorchAttentionBackend()
    backend.set_layers([FULL_ATTENTION, layer])
    backend.init_forward_metadata(p.batch)
    out = backend.forward(p.q, p.k, p.v, 1, p.batch, p.scale)
    torch.testing.assert_close(out, _eager_reference(p, 1, p.scale, layer), rtol=1e-5, atol=1e-5)
    if layer != FULL_ATTENTION:  # the cases are ones where the window or cap matters
        full = backend.forward(p.q, p.k, p.v, 0, p.batch, p.scale)
        assert (full - out).abs().max() > 1e-2


# -- whole models against transformers ------------------------------------------------
def _engine(model_dir: Path, **kwargs: Any) -> Engine:
    return Engine(model_path=str(model_dir), debug_check_invariants=True, **{**ENGINE, **kwargs})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_matches_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    """A 41-token prompt (5x the window) beside a short one, in one continuous batch;
    then prompts that share a 30-token prefix (the second hits the radix cache, its
    window partly over the cached prefix); then the long prompt again, its prefill cut in
    chunks of 8 tokens."""
    model_dir = tiny_dirs[name]
    engine = _engine(model_dir)
    try:
        prompts = make_prompts(engine.runner.vocab_size, [41, 7], seed=4)
        ours = engine_outputs(engine, prompts, MAX_NEW)
        (prefix,) = make_prompts(engine.runner.vocab_size, [30], seed=8)
        tails = make_prompts(engine.runner.vocab_size, [3, 11], seed=9)
        shared = [prefix + tail for tail in tails]
        for ids in shared:  # one at a time: the second reads the first's cached prefix
            out = engine.generate(input_ids=ids, sampling_params=greedy_params(MAX_NEW))
            assert isinstance(out, dict)
            ours.append(out["output_ids"])
        assert out["meta_info"]["cached_tokens"] >= len(prefix)
    finally:
        engine.shutdown()
    chunked = _engine(model_dir, chunked_prefill_size=8, enable_mixed_chunk=False)
    try:
        ours += engine_outputs(chunked, prompts[:1], MAX_NEW)
    finally:
        chunked.shutdown()
    refs = hf_greedy(model_dir, prompts + shared, MAX_NEW, attn_implementation="eager")
    for out_ids, ref in zip(ours, [*refs, refs[0]], strict=True):
        assert_matches_reference(out_ids, ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_windows_and_caps_matter(tiny_dirs: dict[str, Path], name: str) -> None:
    """The tiny models' windows (and Gemma 2's soft-cap) change their greedy tokens, so
    the test above would catch a backend that ignored them."""
    engine = _engine(tiny_dirs[name])
    try:
        config = engine.runner.model_config
        assert any(w == TINY_WINDOW for w in config.layer_windows)
        prompts = make_prompts(engine.runner.vocab_size, [41], seed=4)
        as_configured = engine_outputs(engine, prompts, MAX_NEW)
        layers = layer_attention(config)
        engine.runner.attn.set_layers([FULL_ATTENTION] * len(layers))
        assert engine_outputs(engine, prompts, MAX_NEW) != as_configured
        if config.attn_soft_cap is not None:
            engine.runner.attn.set_layers([LayerAttention(layer.window) for layer in layers])
            assert engine_outputs(engine, prompts, MAX_NEW) != as_configured
    finally:
        engine.shutdown()


class _FullOnly(TorchAttentionBackend):
    """A backend that runs full attention alone (as one without windows would)."""

    name = "full-only"
    supports_layer_attention = False


def test_backend_without_windows_refuses_the_model() -> None:
    backend = _FullOnly()
    backend.set_layers([FULL_ATTENTION] * 2)  # a model without windows is fine
    with pytest.raises(ValueError, match=r"full-only .* window 8; .* torch, triton, flashinfer"):
        backend.set_layers([FULL_ATTENTION, LayerAttention(window=8)])
    with pytest.raises(ValueError, match=r"logit soft-cap 50\.0"):
        backend.set_layers([LayerAttention(soft_cap=50.0)])


def test_windows_turn_cascade_off() -> None:
    backend = TorchAttentionBackend()
    backend.supports_shared_prefix = True  # as the triton and flashinfer backends
    backend.set_layers([FULL_ATTENTION])
    assert backend.supports_shared_prefix
    backend.set_layers([LayerAttention(window=4)])
    assert not backend.supports_shared_prefix


def test_gemma_norms_and_embeddings(tiny_dirs: dict[str, Path]) -> None:
    """Norm weights are stored as 1 + w (q/k norms too); the embedding scale is
    sqrt(hidden) rounded to the weights' dtype, as transformers' (55.5 for sqrt(3072)
    in bfloat16)."""
    from safetensors.torch import load_file
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    model, _ = load_model(tiny_dirs["gemma3"], "float32", "cpu")
    assert isinstance(model, GemmaForCausalLM)
    stored = load_file(str(tiny_dirs["gemma3"] / "model.safetensors"))
    layer = model.model.layers[1]
    for name in ("pre_feedforward_layernorm", "post_attention_layernorm", "self_attn.q_norm"):
        torch.testing.assert_close(
            layer.get_submodule(name).weight, stored[f"model.layers.1.{name}.weight"] + 1.0
        )
    ours = ScaledEmbedding(16, 3072).to(torch.bfloat16)
    theirs = Gemma2TextScaledWordEmbedding(16, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    with torch.no_grad():
        weights = torch.randn(16, 3072).to(torch.bfloat16)
        ours.weight.copy_(weights)
        theirs.weight.copy_(weights)
    ids = torch.tensor([3, 0, 15])
    assert torch.equal(ours(ids), theirs(ids))


def test_gemma3_rope_tables_follow_transformers() -> None:
    """A Hub-style Gemma 3 config (rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones): each layer's cos/sin is transformers'."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    fields = {
        **SMALL,
        "num_hidden_layers": 6,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    model = GemmaForCausalLM(
        ModelConfig.from_dict(
            {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **fields}
        )
    )
    model.init_rotary(64)
    theirs = Gemma3RotaryEmbedding(Gemma3TextConfig(**fields))
    positions = torch.arange(64)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        kind = "full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
        assert isinstance(layer, GemmaDecoderLayer)
        table = layer.local_rotary if kind == "sliding_attention" else model.rotary
        assert table is not None
        cos, sin = theirs(x, positions, kind)
        torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(table.sin, sin[0], rtol=0, atol=1e-6)
