"""Decode CUDA graphs on CUDA: the engine's tokens with graphs equal its tokens without
them and Hugging Face's greedy tokens, at batch sizes that run padded (3 on the graph
of 4, 5 on 8, 17 on 24), and under the radix cache, chunked prefill, retraction,
page_size 16 and per-request sampling parameters (greedy and seeded temperature).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    assert_matches_reference,
    greedy_params,
    hf_greedy,
    make_prompts,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="the graphs run the triton attention backend")

pytestmark = pytest.mark.gpu

MAX_NEW = 24
GRAPH_MAX_BS = 32  # ladder 1, 2, 4, 8, 16, 24, 32: quick to capture


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_graphs"), seed=0))


@pytest.fixture(scope="module")
def vocab(tiny_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_dir).vocab_size)


def _run(
    model_dir: Path,
    prompts: list[list[int]],
    params: list[dict[str, Any]],
    graphs: bool,
    **kwargs: Any,
) -> tuple[list[list[int]], dict[str, int]]:
    """Outputs of one engine, and what its scheduler and graph runner counted."""
    options: dict[str, Any] = {
        "max_total_tokens": 8192,
        "cuda_graph_max_bs": GRAPH_MAX_BS,
        "debug_check_invariants": True,
        **kwargs,
    }
    with Engine(
        model_path=str(model_dir),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        disable_cuda_graph=not graphs,
        **options,
    ) as engine:
        runner = engine.runner.graphs
        assert (runner is not None) == graphs
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(outs, list)
        counts = {
            "replays": runner.num_replays if runner is not None else 0,
            "retractions": engine.scheduler.total_retractions,
            "cached": engine.scheduler.total_cached_tokens,
        }
        return [o["output_ids"] for o in outs], counts


@pytest.mark.parametrize("batch_size", [3, 5, 17])
def test_padded_graphs_equal_eager_and_hugging_face(
    tiny_dir: Path, vocab: int, batch_size: int
) -> None:
    lengths = [3 + (7 * i) % 61 for i in range(batch_size)]
    prompts = make_prompts(vocab, lengths, seed=batch_size)
    params = [greedy_params(MAX_NEW)] * batch_size
    with_graphs, counts = _run(tiny_dir, prompts, params, graphs=True)
    without, _ = _run(tiny_dir, prompts, params, graphs=False)
    assert with_graphs == without
    # Every step after the prefill decodes all the requests on a padded graph.
    assert counts["replays"] >= MAX_NEW - 1
    for out, ref in zip(with_graphs, hf_greedy(tiny_dir, prompts, MAX_NEW, "cuda"), strict=True):
        assert_matches_reference(out, ref)


def _mixed_params(count: int) -> list[dict[str, Any]]:
    """Every third request samples (seeded: the draws depend on seed and position only)."""
    params: list[dict[str, Any]] = []
    for i in range(count):
        if i % 3 == 1:
            params.append(
                {"max_new_tokens": MAX_NEW, "temperature": 0.8, "top_p": 0.9, "seed": 50 + i}
                | {"ignore_eos": True}
            )
        else:
            params.append(greedy_params(MAX_NEW - 4 * (i % 2)))  # some finish earlier
    return params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunked_prefill_size": 16},
        {"max_total_tokens": 240},  # forces retraction
        {"page_size": 16, "chunked_prefill_size": 16},
        {"page_size": 16, "max_total_tokens": 320},
    ],
    ids=["chunked", "retraction", "pages", "pages-retraction"],
)
def test_graphs_under_cache_chunking_retraction_and_sampling(
    tiny_dir: Path, vocab: int, kwargs: dict[str, Any]
) -> None:
    base = make_prompts(vocab, [40, 5, 17, 64, 3, 33, 12, 90, 9], seed=5)
    # Shared prefixes, so the radix cache serves some prefills.
    prompts = base + [base[3][:48] + p for p in base[:4]]
    params = _mixed_params(len(prompts))
    reference, _ = _run(tiny_dir, prompts, params, graphs=False)
    without, _ = _run(tiny_dir, prompts, params, graphs=False, **kwargs)
    with_graphs, counts = _run(tiny_dir, prompts, params, graphs=True, **kwargs)
    assert with_graphs == without == reference
    assert counts["replays"] > 0 and counts["cached"] > 0
    if "max_total_tokens" in kwargs:
        assert counts["retractions"] > 0, "the pool was meant to force retraction"


def test_torch_backend_runs_without_graphs(tiny_dir: Path, vocab: int) -> None:
    prompts = make_prompts(vocab, [5, 9], seed=1)
    with Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        max_total_tokens=2048,
        attention_backend="torch",
    ) as engine:
        assert engine.runner.graphs is None  # the torch backend has none
        out = engine.generate(input_ids=prompts, sampling_params=greedy_params(4))
        assert isinstance(out, list) and all(len(o["output_ids"]) == 4 for o in out)
