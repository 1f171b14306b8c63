"""Tensor parallelism on two GPUs (NCCL): greedy tokens of an engine of two ranks equal
one GPU's on the same float32 weights, on each attention backend, with decode CUDA graphs
and prefill pieces (their all-reduces, the vocabulary-parallel embeddings' included, and
the head's all-gather captured) and without; the collectives call NCCL directly (engine/nccl.py).
FlashInfer runs half precision only, so its backend and `auto` (FlashInfer's prefill,
Triton's decode) are checked in bfloat16 against Hugging Face in float32, as the one-GPU
FlashInfer tests are. Skips below 2 GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    engine_outputs,
    hf_greedy,
    make_prompts,
)

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tp"), seed=0))


@pytest.mark.parametrize(
    ("backend", "graphs"), [("triton", True), ("triton", False), ("torch", False)]
)
def test_two_gpus_generate_what_one_does(model_dir: Path, backend: str, graphs: bool) -> None:
    options = {
        "device": "cuda",
        "dtype": "float32",
        "max_total_tokens": 8192,
        "attention_backend": backend,
        "disable_cuda_graph": not graphs,
        "cuda_graph_max_bs": 8,
    }
    params = {"max_new_tokens": 16, "temperature": 0}
    one = Engine(str(model_dir), **options)
    try:
        prompts = make_prompts(one.runner.vocab_size, [7, 40, 13, 90], seed=2)
        expected = one.generate(input_ids=prompts, sampling_params=params)
    finally:
        one.shutdown()
    two = Engine(str(model_dir), tp_size=2, **options)
    try:
        assert two.runner.kv_pool.k_buffers[0].shape[1] == 1  # 2 KV heads over 2 ranks
        assert (two.runner.graphs is not None) == graphs
        assert two.runner.tp.nccl is not None  # the probe against torch.distributed passed
        # The vocabulary-parallel head and embeddings: each rank its half, the logits
        # all-gathered, the embeddings all-reduced (captured in the graphs too).
        assert two.runner.model.lm_head.weight.shape[0] == two.runner.vocab_size // 2
        assert two.runner.model.model.embed_tokens.weight.shape[0] == two.runner.vocab_size // 2
        got = two.generate(input_ids=prompts, sampling_params=params)
        # With graphs, the prefill (4 prompts, 150 tokens) ran on the captured pieces,
        # their all-reduces captured on both ranks.
        pieces = two.runner.piecewise  # held through shutdown, which must still end
        assert (pieces is not None and pieces.num_replays > 0) == graphs
    finally:
        two.shutdown()
    assert isinstance(expected, list) and isinstance(got, list)
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]


# bfloat16 against float32 Hugging Face: a divergence only where the reference's top-2
# gap is below this (test_flashinfer_attention_cuda.py's bound).
BF16_TIE_TOLERANCE = 0.5


@pytest.fixture(scope="module")
def head128_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 128 (FlashInfer builds its kernels per head dim); 4 query heads over 2 KV
    heads: one KV head and two query heads a rank."""
    folder = tmp_path_factory.mktemp("tiny_llama_tp_head128")
    return Path(make_tiny_llama(folder, seed=0, head_dim=128, num_key_value_heads=2))


@pytest.mark.parametrize(
    ("backend", "graphs"), [("flashinfer", True), ("auto", True), ("auto", False)]
)
def test_two_gpus_half_precision_match_hf(head128_dir: Path, backend: str, graphs: bool) -> None:
    pytest.importorskip("flashinfer")
    # 5 and 17 requests decode on the padded graphs of 8 and 24; chunks of 16 tokens put
    # decoders beside prefill chunks (mixed batches).
    lengths = [3 + (7 * i) % 61 for i in range(17)]
    with Engine(
        str(head128_dir),
        tp_size=2,
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=8192,
        attention_backend=backend,
        chunked_prefill_size=16,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=32,
    ) as engine:
        expected_name = "flashinfer" if backend == "flashinfer" else "flashinfer+triton"
        assert engine.runner.attn.name == expected_name
        assert engine.runner.kv_pool.k_buffers[0].shape[1] == 1  # 2 KV heads over 2 ranks
        assert (engine.runner.graphs is not None) == graphs
        prompts = make_prompts(engine.runner.vocab_size, lengths, seed=5)
        ours = engine_outputs(engine, prompts[:5], 24) + engine_outputs(engine, prompts, 24)
        pieces = engine.runner.piecewise  # the 16-token chunks and mixed passes ran on them
        assert (pieces is not None and pieces.num_replays > 0) == graphs
    refs = hf_greedy(head128_dir, prompts[:5] + prompts, 24, device="cuda")
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref, tolerance=BF16_TIE_TOLERANCE)


@pytest.mark.parametrize("path", ["direct", "torch.distributed"])
def test_a_rank_lost_inside_an_all_reduce_ends_rank_0s_wait(model_dir: Path, path: str) -> None:
    """Rank 1 dies while rank 0 is inside an all-reduce (as in the middle of a step or
    of the warm-up), which NCCL's kernel would wait out without end: rank 0's watch
    aborts the collectives, the wait ends, the engine raises `RankLost` and shuts down
    at once (`rank_loss_child.py`, in a process of its own: the process that aborted
    NCCL starts no other tensor-parallel engine)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.rank_loss_child", str(model_dir), path],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 stopped" in done.stdout, done.stdout[-3000:]
