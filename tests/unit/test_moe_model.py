"""Mixtral, Qwen2-MoE (shared expert, a dense layer by mlp_only_layers) and Qwen3-MoE
(q/k norms, norm_topk_prob): greedy tokens of tiny random models through the engine
equal transformers' generate (float32, CPU: the torch reference experts); two
tensor-parallel ranks (gloo) generate what one does; bad checkpoints and configs are
refused clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve import Engine
from radixserve.engine.model.loader import load_model
from radixserve.engine.model.moe import MoEConfig
from radixserve.engine.model.moe_models import MoEDecoderLayer
from radixserve.model_files.config import ModelConfig
from tests.helpers.tiny_models import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 24
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral"), seed=5)


@pytest.fixture(scope="module")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("tiny_qwen2_moe"), seed=6)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=7)


def _check_greedy(model_dir: Path, lengths: list[int]) -> None:
    engine = Engine(model_path=str(model_dir), debug_check_invariants=True, **ENGINE)
    try:
        prompts = make_prompts(engine.runner.vocab_size, lengths, seed=4)
        # One call: the prompts share continuous batches of mixed lengths.
        ours = engine_outputs(engine, prompts, MAX_NEW)
    finally:
        engine.shutdown()
    refs = hf_greedy(model_dir, prompts, MAX_NEW)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref)


@pytest.mark.slow
def test_tiny_mixtral_matches_hf(tiny_mixtral_dir: Path) -> None:
    _check_greedy(tiny_mixtral_dir, [5, 23, 1, 17])


@pytest.mark.slow
def test_tiny_qwen2_moe_matches_hf(tiny_qwen2_moe_dir: Path) -> None:
    _check_greedy(tiny_qwen2_moe_dir, [9, 2, 31])


@pytest.mark.slow
def test_tiny_qwen3_moe_matches_hf(tiny_qwen3_moe_dir: Path) -> None:
    _check_greedy(tiny_qwen3_moe_dir, [14, 3, 27])


def test_layers_and_routing_follow_the_config(
    tiny_mixtral_dir: Path, tiny_qwen2_moe_dir: Path, tiny_qwen3_moe_dir: Path
) -> None:
    mixtral, _ = load_model(tiny_mixtral_dir, "float32", "cpu")
    assert all(isinstance(layer, MoEDecoderLayer) for layer in mixtral.model.layers)
    block = mixtral.model.layers[0].moe
    assert tuple(block.w13.shape) == (8, 2 * 128, 64) and tuple(block.w2.shape) == (8, 64, 128)
    assert block.routing.renormalize and not block.routing.round_weights
    assert block.shared_expert is None

    qwen2, config = load_model(tiny_qwen2_moe_dir, "float32", "cpu")
    kinds = [isinstance(layer, MoEDecoderLayer) for layer in qwen2.model.layers]
    assert kinds == [True, False, True]  # mlp_only_layers [1]
    assert config.qkv_bias and not config.o_bias
    shared = qwen2.model.layers[0].moe
    assert shared.shared_expert is not None and shared.shared_expert.intermediate_size == 96
    assert not shared.routing.renormalize and shared.routing.round_weights

    qwen3, config = load_model(tiny_qwen3_moe_dir, "float32", "cpu")
    kinds = [isinstance(layer, MoEDecoderLayer) for layer in qwen3.model.layers]
    assert kinds == [False, True, False]  # decoder_sparse_step 2: layers 2, 4, ...
    assert config.qk_norm and qwen3.model.layers[1].moe.routing.renormalize


def test_expert_weights_are_stacked_from_the_checkpoint(tiny_mixtral_dir: Path) -> None:
    model, _ = load_model(tiny_mixtral_dir, "float32", "cpu")
    stored = load_file(str(tiny_mixtral_dir / "model.safetensors"))
    block = model.model.layers[2].moe
    prefix = "model.layers.2.block_sparse_moe"
    for e in (0, 5, 7):
        w1, w3 = (
            stored[f"{prefix}.experts.{e}.w1.weight"],
            stored[f"{prefix}.experts.{e}.w3.weight"],
        )
        torch.testing.assert_close(block.w13[e], torch.cat([w1, w3]), rtol=0, atol=0)
        torch.testing.assert_close(block.w2[e], stored[f"{prefix}.experts.{e}.w2.weight"])
    torch.testing.assert_close(block.gate.weight, stored[f"{prefix}.gate.weight"])


def _copy_checkpoint(src: Path, dst: Path, drop: str) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != drop}, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_and_configs_are_refused(tiny_qwen2_moe_dir: Path, tmp_path: Path) -> None:
    lacking = _copy_checkpoint(
        tiny_qwen2_moe_dir, tmp_path / "lacking", "model.layers.2.mlp.experts.4.up_proj.weight"
    )
    with pytest.raises(ValueError, match=r"lacks 1 weights: model\.layers\.2\.moe\.w13\[9\]"):
        load_model(lacking, "float32", "cpu")

    raw = json.loads((tiny_qwen2_moe_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"num_experts_per_tok 7 must be in 1\.\.num_experts"):
        MoEConfig.of(ModelConfig.from_dict({**raw, "num_experts_per_tok": 7}))
    with pytest.raises(ValueError, match="lacks 'moe_intermediate_size'"):
        MoEConfig.of(ModelConfig.from_dict({**raw, "moe_intermediate_size": None}))

    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for path in tiny_qwen2_moe_dir.iterdir():
        (fewer / path.name).write_bytes(path.read_bytes())
    (fewer / "config.json").write_text(json.dumps({**raw, "num_experts": 4}))
    with pytest.raises(ValueError, match="names expert 4; the config has 4"):
        load_model(fewer, "float32", "cpu")


@pytest.mark.slow
def test_two_ranks_generate_what_one_does(tiny_qwen2_moe_dir: Path) -> None:
    """Qwen2-MoE over two gloo ranks: each holds half of every expert's, the shared
    expert's and the dense layer's intermediate rows; the tokens are one rank's."""
    one = Engine(str(tiny_qwen2_moe_dir), **ENGINE)
    two = Engine(str(tiny_qwen2_moe_dir), tp_size=2, **ENGINE)
    try:
        block = two.runner.model.model.layers[0].moe
        assert block.w13.shape[1] == 48 and block.w2.shape[2] == 24  # 48 rows / 2 ranks
        assert block.shared_expert.intermediate_size == 48
        assert two.runner.model.model.layers[1].mlp.intermediate_size == 64
        prompts = make_prompts(one.runner.vocab_size, [6, 29, 11], seed=9)
        params = {"max_new_tokens": 12, "temperature": 0}
        expected = one.generate(input_ids=prompts, sampling_params=params)
        got = two.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(expected, list) and isinstance(got, list)
        assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    finally:
        two.shutdown()
        one.shutdown()
