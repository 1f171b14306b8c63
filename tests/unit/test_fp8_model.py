"""FP8 checkpoints and --quantization fp8 on the CPU (FP8 weights dequantized in the
kernels' torch path): a tiny random Llama written by llm-compressor's routines
(compressed-tensors, per channel and per tensor) and in the "quant_method": "fp8" layout
(weight_scale / weight_scale_inv), checked against transformers' Llama holding the same
weights dequantized; a 16-bit model quantized on load against itself unquantized;
unsupported schemes refused at start-up with what is supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from radixserve import Engine
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.config import EngineConfig
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8 import dequantize
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.model.loader import load_model
from radixserve.engine.model.quantization import PROJECTIONS, Fp8Linear
from tests.helpers.batches import PagedRequests
from tests.helpers.fp8_checkpoints import (
    write_compressed_tensors,
    write_dequantized,
    write_fp8_method,
)
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 16
LENGTHS = [5, 23, 1, 17]
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}
# Our FP8 model against transformers' with the same dequantized weights, float32: the
# same products in another order (measured 3e-7 relative).
SAME_WEIGHTS_RTOL = 1e-4
# --quantization fp8 against the unquantized model (relative Frobenius norm of the
# last-token logits): per-channel e4m3 moves a random weight matrix by 2.5%, and the
# 3-layer tiny models' logits by 8.5% (Llama, seed 3) and 8.6% (Qwen2, seed 2), measured.
FP8_LOGITS_RTOL = 0.12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=3)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    """Each FP8 checkpoint of the tiny model, by its layout."""
    root = tmp_path_factory.mktemp("fp8")
    return {
        "ct-channel": write_compressed_tensors(tiny_dir, root / "ct-channel"),
        "ct-tensor": write_compressed_tensors(tiny_dir, root / "ct-tensor", strategy="tensor"),
        "fp8-tensor": write_fp8_method(tiny_dir, root / "fp8-tensor"),
        "fp8-channel-inv": write_fp8_method(
            tiny_dir, root / "fp8-channel-inv", per_channel=True, scale_name="weight_scale_inv"
        ),
    }


def _last_logits(model: nn.Module, config: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Our model's logits at each prompt's last token, one extend pass over them all."""
    c = config
    pool = KVPool(
        1024, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
    )
    requests = PagedRequests(pool, ReqToTokenPool(8, 512, "cpu"))
    rows = [requests.new_request() for _ in prompts]
    batch = requests.build(ForwardMode.EXTEND, list(zip(rows, prompts, strict=True)))
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        backend.init_forward_metadata(batch)
        return model(batch, backend).float()


def _reference_logits(folder: Path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([ids])).logits[0, -1] for ids in prompts])


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "fp8-tensor", "fp8-channel-inv"])
def test_fp8_checkpoint_loads_as_stored(
    layout: str, fp8_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Every projection FP8 with the checkpoint's own codes; the head and embeddings
    16-bit; logits equal transformers' on the dequantized weights."""
    folder = fp8_dirs[layout]
    model, config = load_model(folder, torch.float32, "cpu")
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            assert isinstance(module, Fp8Linear), name
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    reference_dir = write_dequantized(folder, tmp_path / "dequantized")
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj
    codes = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), codes.view(torch.uint8))
    reference = load_file(str(reference_dir / "model.safetensors"))
    gate_up = model.model.layers[2].mlp.gate_up_proj
    expected = torch.cat([reference[f"model.layers.2.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(dequantize(gate_up.fp8_weight(), torch.float32), expected)

    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    ours = _last_logits(model, config, prompts)
    assert _relative_error(ours, _reference_logits(reference_dir, prompts)) < SAME_WEIGHTS_RTOL


def test_compressed_tensors_reads_as_transformers_decompresses(fp8_dirs: dict[str, Path]) -> None:
    """Our reading of the compressed-tensors layout against its own decompression (in
    transformers, which rounds weight * scale to the scale's bfloat16)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = fp8_dirs["ct-channel"]
    decompressed = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model, _ = load_model(folder, torch.float32, "cpu")
    ours = dequantize(model.model.layers[0].mlp.down_proj.fp8_weight(), torch.float32)
    theirs = decompressed.model.layers[0].mlp.down_proj.weight.float()
    torch.testing.assert_close(ours, theirs, rtol=2**-8, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ct-channel", "fp8-channel-inv"])
def test_fp8_checkpoint_greedy_matches_transformers(
    layout: str, fp8_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = fp8_dirs[layout]
    engine = Engine(model_path=str(folder), debug_check_invariants=True, **ENGINE)
    try:
        prompts = make_prompts(engine.runner.vocab_size, LENGTHS, seed=4)
        ours = engine_outputs(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    refs = hf_greedy(write_dequantized(folder, tmp_path / "dequantized"), prompts, MAX_NEW)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref)


def test_quantize_on_load_tracks_the_16_bit_model(tiny_dir: Path) -> None:
    model, config = load_model(tiny_dir, torch.float32, "cpu", quantization="fp8")
    layers = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    assert len(layers) == 4 * config.num_hidden_layers
    assert all(isinstance(m, Fp8Linear) for m in layers)
    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    ours = _last_logits(model, config, prompts)
    error = _relative_error(ours, _reference_logits(tiny_dir, prompts))
    assert 0 < error < FP8_LOGITS_RTOL


def test_quantize_on_load_keeps_biases_and_the_tied_head(tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases, a tied head): biases stay float, the head is the embeddings."""
    folder = make_tiny_qwen2(tmp_path / "qwen2", seed=2)
    model, config = load_model(folder, torch.float32, "cpu", quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.bias is not None
    assert qkv.bias.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    error = _relative_error(
        _last_logits(model, config, prompts), _reference_logits(folder, prompts)
    )
    assert error < FP8_LOGITS_RTOL


def test_an_ignore_list_keeps_its_layers_16_bit(tiny_dir: Path, tmp_path: Path) -> None:
    ignore = ("lm_head", "re:.*layers\\.0\\.mlp\\..*")
    folder = write_compressed_tensors(tiny_dir, tmp_path / "ct", ignore=ignore)
    model, config = load_model(folder, torch.float32, "cpu")
    mlp0, mlp1 = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert type(mlp0.gate_up_proj) is nn.Linear and type(mlp0.down_proj) is nn.Linear
    assert isinstance(mlp1.gate_up_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    prompts = make_prompts(config.vocab_size, LENGTHS, seed=1)
    reference = _reference_logits(write_dequantized(folder, tmp_path / "ref"), prompts)
    assert _relative_error(_last_logits(model, config, prompts), reference) < SAME_WEIGHTS_RTOL


def test_an_ignore_list_splitting_a_fused_projection_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = write_compressed_tensors(tiny_dir, tmp_path / "ct", ignore=("lm_head", "re:.*k_proj$"))
    with pytest.raises(ValueError, match="fuses them into one projection"):
        load_model(folder, torch.float32, "cpu")


def _with_quantization_config(src: Path, dst: Path, quantization: dict[str, Any]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        (
            {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
            "block-wise FP8",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "method 'gptq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group"},
                    }
                },
            },
            "group 'group_0'",
        ),
    ],
)
def test_unsupported_schemes_are_refused_at_start_up(
    tiny_dir: Path, tmp_path: Path, quantization: dict[str, Any], message: str
) -> None:
    folder = _with_quantization_config(tiny_dir, tmp_path / "model", quantization)
    with pytest.raises(ValueError, match=message) as info:
        Engine(model_path=str(folder), **ENGINE)
    assert "supported: FP8 checkpoints" in str(info.value)


def test_quantization_option_and_variable() -> None:
    from radixserve.engine.flags import engine_kwargs

    with pytest.raises(ValueError, match="quantization must be fp8"):
        EngineConfig(quantization="int4")
    import argparse

    from radixserve.engine.flags import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--quantization", "fp8"]), {})["quantization"] == "fp8"
    kwargs = engine_kwargs(parser.parse_args([]), {"RADIXSERVE_QUANTIZATION": "fp8"})
    assert kwargs["quantization"] == "fp8"


@pytest.mark.slow
def test_engine_quantizes_on_load_as_the_fp8_layout(tiny_dir: Path, tmp_path: Path) -> None:
    """--quantization fp8 in the engine: greedy tokens equal transformers' on the weights
    quantized per channel as the "fp8" checkpoint helper does (the same arithmetic)."""
    fp8 = write_fp8_method(tiny_dir, tmp_path / "fp8", per_channel=True)
    reference_dir = write_dequantized(fp8, tmp_path / "dequantized")
    engine = Engine(model_path=str(tiny_dir), quantization="fp8", **ENGINE)
    try:
        down = engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down, Fp8Linear)
        prompts = make_prompts(engine.runner.vocab_size, LENGTHS, seed=4)
        ours = engine_outputs(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    for out, ref in zip(ours, hf_greedy(reference_dir, prompts, MAX_NEW), strict=True):
        assert_matches_reference(out, ref)
