"""Tensor parallelism on two GPUs (NCCL): greedy tokens of an engine of two ranks equal
one GPU's on the same float32 weights, on each attention backend, with decode CUDA graphs
(their all-reduces and the vocabulary-parallel head's all-gather captured) and without;
the collectives call NCCL directly (engine/nccl.py). Skips below 2 GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import Engine
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import make_prompts

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
        # The vocabulary-parallel head: each rank its half, the logits all-gathered.
        assert two.runner.model.lm_head.weight.shape[0] == two.runner.vocab_size // 2
        got = two.generate(input_ids=prompts, sampling_params=params)
    finally:
        two.shutdown()
    assert isinstance(expected, list) and isinstance(got, list)
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
