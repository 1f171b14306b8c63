"""Every attention backend on CUDA, with and without CUDA graphs (and overlap scheduling
where the engine has it), gives Hugging Face transformers' greedy tokens on the same
random weights: a tiny float32 Llama (as the other GPU parity tests), a batch of mixed
prompt lengths, then a second batch that extends the first one's prompts (radix hits),
then a third whose prompts share a 72-token head: its decode steps (5 requests) run
cascade attention where the backend has it, eagerly without graphs and on the graph
of 8's cascade variant with them; then one prompt alone (decode at batch 1, where the
projections are one-token GEMVs with the norms and SiLU x mul folded in).

The grid comes from EngineConfig: a backend it admits appears here when its module is
importable, an overlap switch as soon as the config has one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.engine.config import ATTENTION_BACKENDS, EngineConfig
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import (
    Reference,
    assert_matches_reference,
    greedy_params,
    hf_greedy,
    make_prompts,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

MAX_NEW = 24
LENGTHS = [5, 17, 40, 3, 64, 90]  # padded onto the graph of 8
OVERLAP_FIELD = "disable_overlap_schedule"


def _backends() -> list[str]:
    """The named backends EngineConfig admits whose module is importable (torch: always).
    FlashInfer runs half precision only: its float16/bfloat16 parity with Hugging Face,
    graphs and overlap on and off, is in test_flashinfer_attention_cuda.py."""
    return [
        name
        for name in ATTENTION_BACKENDS
        if name not in ("auto", "flashinfer")
        and (name == "torch" or importlib.util.find_spec(name) is not None)
    ]


def _grid() -> list[Any]:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    overlaps: list[bool | None] = [False, True] if OVERLAP_FIELD in fields else [None]
    return [
        pytest.param(backend, graphs, overlap, id=f"{backend}-graphs_{graphs}-overlap_{overlap}")
        for backend in _backends()
        for graphs in (True, False)
        for overlap in overlaps
    ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_parity"), seed=0))


@pytest.fixture(scope="module")
def rounds(tiny_dir: Path) -> list[tuple[list[list[int]], list[Reference]]]:
    """Four batches and their references: the second's prompts extend the first's."""
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(tiny_dir).vocab_size)
    first = make_prompts(vocab, LENGTHS, seed=11)
    tails = make_prompts(vocab, [4, 9, 1, 30], seed=12)
    second = [first[4] + tails[0], first[5][:50] + tails[1], first[1] + tails[2], tails[3]]
    system, *questions = make_prompts(vocab, [72, 3, 8, 20, 5, 11], seed=13)
    third = [system + q for q in questions]
    # One request alone: its decode steps run at batch 1, the one-token GEMVs.
    fourth = make_prompts(vocab, [37], seed=14)
    rounds = (first, second, third, fourth)
    return [(p, hf_greedy(tiny_dir, p, MAX_NEW, device="cuda")) for p in rounds]


@pytest.mark.parametrize(("backend", "graphs", "overlap"), _grid())
def test_greedy_tokens_equal_hugging_face(
    tiny_dir: Path,
    rounds: list[tuple[list[list[int]], list[Reference]]],
    backend: str,
    graphs: bool,
    overlap: bool | None,
) -> None:
    options: dict[str, Any] = {} if overlap is None else {OVERLAP_FIELD: not overlap}
    with Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
        max_total_tokens=8192,
        debug_check_invariants=True,
        **options,
    ) as engine:
        if graphs and engine.runner.graphs is None:
            pytest.skip(f"the {backend} backend has no CUDA graphs")
        assert (engine.runner.graphs is not None) == graphs
        cached = []
        for prompts, refs in rounds:
            outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(MAX_NEW))
            assert isinstance(outs, list)
            for out, ref in zip(outs, refs, strict=True):
                assert_matches_reference(out["output_ids"], ref)
            cached.append(sum(o["meta_info"]["cached_tokens"] for o in outs))
        replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
        assert engine.runner.graphs is None or engine.runner.graphs.cascade_sizes == [8]
        cascade_steps = engine.scheduler.total_cascade_steps
    # The second batch finds three of its prompts' heads in the radix cache.
    assert cached[1] >= 64 + 50 + 17
    assert cascade_steps > 0 if backend != "torch" else cascade_steps == 0
    assert replays > 0 if graphs else replays == 0
