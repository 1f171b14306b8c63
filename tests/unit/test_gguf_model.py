"""A GGUF served with its blocks kept (--gguf-weights quantized): the converted folder,
the loaded layers and their memory, and greedy tokens equal to transformers' on the
dequantized folder (the same numbers): a tiny random llama written as GGUF with every
kept type (a Q4_K q/k beside a Q6_K v, as Q4_K_M files have, and an F16 projection that
stays dense), and the embedded SmolLM2 Q4_1 (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from safetensors import safe_open
from torch import nn

from radixserve import Engine
from radixserve.engine.kernels.block_quant import dequantize
from radixserve.engine.model.loader import load_model
from radixserve.engine.model.quantization import BlockQuantLinear, weight_of
from radixserve.model_files.gguf_convert import (
    DEQUANTIZED,
    QUANTIZED,
    convert_gguf,
    converted_dir,
    embedded_gguf_path,
)
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)
from tests.unit.test_gguf_blocks import random_blocks

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# GGUF type of each projection, per layer (None: F16, written dense).
TYPES: list[dict[str, QType | None]] = [
    {
        "attn_q": QType.Q4_K,
        "attn_k": QType.Q4_K,
        "attn_v": QType.Q6_K,
        "attn_output": QType.Q4_0,
        "ffn_gate": QType.Q4_1,
        "ffn_up": QType.Q4_1,
        "ffn_down": QType.Q8_0,
    },
    {
        "attn_q": QType.Q8_0,
        "attn_k": QType.Q8_0,
        "attn_v": QType.Q8_0,
        "attn_output": None,
        "ffn_gate": QType.Q6_K,
        "ffn_up": QType.Q6_K,
        "ffn_down": QType.Q4_0,
    },
]
# Scales that keep a random model's activations sane: the K-quants multiply theirs by
# 6- or 8-bit sub-scales.
_SCALE = {QType.Q4_K: 3e-4, QType.Q6_K: 3e-4}
MAX_NEW = 24


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny llama GGUF with random blocks and the embedded model's tokenizer."""
    source = GGUFReader(str(embedded_gguf_path()))
    writer = GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    gen = np.random.default_rng(seed)
    embed = random_blocks(QType.Q8_0, vocab, HIDDEN, seed=seed, scale=0.002)
    writer.add_tensor("token_embd.weight", embed, raw_dtype=QType.Q8_0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    for layer, types in enumerate(TYPES):
        for norm in ("attn_norm", "ffn_norm"):
            weights = (1 + 0.1 * gen.standard_normal(HIDDEN)).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{norm}.weight", weights)
        for name, qtype in types.items():
            rows, k = shapes[name]
            tensor_seed = seed + 100 * layer + len(name)
            if qtype is None:
                dense = (gen.standard_normal((rows, k)) * k**-0.5).astype(np.float16)
                writer.add_tensor(f"blk.{layer}.{name}.weight", dense)
                continue
            raw = random_blocks(qtype, rows, k, seed=tensor_seed, scale=_SCALE.get(qtype, 0.01))
            writer.add_tensor(f"blk.{layer}.{name}.weight", raw, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the .gguf file, the conversion cache holding both of its folders)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    path = write_tiny_gguf(root / "tiny.gguf")
    for weights in (QUANTIZED, DEQUANTIZED):
        convert_gguf(path, root / "cache", weights)
    return path, root / "cache"


def _weight_bytes(model: nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_folder_holds_the_blocks(tiny_gguf: tuple[Path, Path]) -> None:
    path, cache = tiny_gguf
    folder = converted_dir(path, cache, QUANTIZED)
    assert folder != converted_dir(path, cache, DEQUANTIZED)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    # q/k (Q4_K) widened to v's (Q6_K) layout: 8-bit codes, float32 scales, mins.
    assert dtypes[f"{attn}.q_proj.codes"] == dtypes[f"{attn}.v_proj.codes"] == "I8"
    assert dtypes[f"{attn}.q_proj.block_scales"] == "F32" and f"{attn}.v_proj.block_mins" in dtypes
    assert dtypes[f"{attn}.o_proj.codes"] == "U8"  # Q4_0: 4-bit with mins
    assert dtypes[f"{mlp}.gate_proj.block_scales"] == "F16"  # Q4_1: the file's own
    assert f"{mlp}.down_proj.block_mins" not in dtypes  # Q8_0
    assert dtypes["model.layers.1.self_attn.o_proj.weight"] == "F32"  # F16 in the file
    assert not any(name.endswith("proj.weight") and "o_proj" not in name for name in dtypes)


def test_layers_and_memory(tiny_gguf: tuple[Path, Path]) -> None:
    path, cache = tiny_gguf
    quantized, _ = load_model(converted_dir(path, cache, QUANTIZED), "float32", "cpu")
    dense, _ = load_model(converted_dir(path, cache, DEQUANTIZED), "float32", "cpu")
    layers = quantized.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, BlockQuantLinear)
    assert isinstance(layers[1].mlp.down_proj, BlockQuantLinear)
    assert type(layers[1].self_attn.o_proj) is nn.Linear
    projections = sum(_weight_bytes(m) for m in layers)
    assert projections < 0.4 * sum(_weight_bytes(m) for m in dense.model.layers)


def test_greedy_matches_dequantized(
    tiny_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .gguf through --gguf-weights quantized (the cached conversion) against
    transformers on the dequantized folder; on the CPU in float32 both multiply the same
    float32 weights."""
    path, cache = tiny_gguf
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))
    engine = Engine(
        model_path=str(path),
        gguf_weights=QUANTIZED,
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
    )
    assert engine.runner.model_path == converted_dir(path, cache, QUANTIZED)
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40])
    ours = engine_outputs(engine, prompts, MAX_NEW)
    refs = hf_greedy(converted_dir(path, cache, DEQUANTIZED), prompts, MAX_NEW)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref)
    assert len({tuple(o) for o in ours}) > 1  # not one degenerate answer for all


def test_bfloat16_tracks_the_dequantized_model(tiny_gguf: tuple[Path, Path]) -> None:
    """bfloat16 activations: the blocks dequantize to the bfloat16 weights a dequantized
    folder loads as, so logits agree exactly on the CPU."""
    path, cache = tiny_gguf
    quantized, _ = load_model(converted_dir(path, cache, QUANTIZED), "bfloat16", "cpu")
    dense, _ = load_model(converted_dir(path, cache, DEQUANTIZED), "bfloat16", "cpu")
    for ours, theirs in zip(quantized.model.layers, dense.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            weight = weight_of(ours.get_submodule(name))
            wide = (
                weight if isinstance(weight, torch.Tensor) else dequantize(weight, torch.bfloat16)
            )
            assert torch.equal(wide, theirs.get_submodule(name).weight), name


def test_fp8_on_gguf_blocks_is_refused(tiny_gguf: tuple[Path, Path]) -> None:
    path, cache = tiny_gguf
    with pytest.raises(ValueError, match="gguf-weights dequantized"):
        load_model(converted_dir(path, cache, QUANTIZED), "float32", "cpu", quantization="fp8")


def test_bad_gguf_weights_value() -> None:
    with pytest.raises(ValueError, match="gguf_weights"):
        convert_gguf(embedded_gguf_path(), weights="int3")
    with pytest.raises(ValueError, match="gguf_weights"):
        Engine(gguf_weights="int3", device="cpu")


@pytest.mark.slow
def test_embedded_smollm2_kept_small(smollm2_dir: Path) -> None:
    """The embedded Q4_1 model: its weights in at most 0.35x the float32 folder's bytes,
    and the same greedy tokens as transformers on the float32 folder."""
    from radixserve.model_files.paths import resolve_model_path

    folder = resolve_model_path(None, gguf_weights=QUANTIZED)
    quantized, _ = load_model(folder, "float32", "cpu")
    dense, _ = load_model(smollm2_dir, "float32", "cpu")
    assert _weight_bytes(quantized) <= 0.35 * _weight_bytes(dense)
    del quantized, dense
    engine = Engine(model_path=str(folder), device="cpu", dtype="float32")
    prompts = make_prompts(engine.runner.vocab_size, [9, 33])
    ours = engine_outputs(engine, prompts, 16)
    for out, ref in zip(ours, hf_greedy(smollm2_dir, prompts, 16), strict=True):
        assert_matches_reference(out, ref)
