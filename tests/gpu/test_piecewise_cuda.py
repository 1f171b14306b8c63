"""Prefill pieces captured as CUDA graphs (graphs/piecewise.py), on CUDA: the engine's
tokens with them equal its tokens without them (piecewise_cuda_graph_max_tokens 0) and
Hugging Face's greedy tokens, for prompts that run padded in the pieces, chunked prompts
beside decoders (mixed passes), passes past the limit (eager), prompt logprobs, and in
half precision on each backend the first tokens' log-probabilities.
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
pytest.importorskip("triton", reason="the pieces run with the triton attention backend")

pytestmark = pytest.mark.gpu

MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_pieces"), seed=0))


@pytest.fixture(scope="module")
def half_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 128: FlashInfer's prefill kernels are built for it, not for 16."""
    folder = tmp_path_factory.mktemp("tiny_llama_pieces_128")
    return Path(make_tiny_llama(folder, seed=0, head_dim=128, num_key_value_heads=1))


@pytest.fixture(scope="module")
def vocab(tiny_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_dir).vocab_size)


def _engine(model_dir: Path, max_tokens: int, **kwargs: Any) -> Engine:
    options: dict[str, Any] = {
        "device": "cuda",
        "dtype": "float32",
        "attention_backend": "triton",
        "max_total_tokens": 8192,
        "cuda_graph_max_bs": 16,
        "piecewise_cuda_graph_max_tokens": max_tokens,
        "debug_check_invariants": True,
        **kwargs,
    }
    return Engine(model_path=str(model_dir), **options)


def _generate(engine: Engine, prompts: list[list[int]], params: Any) -> list[dict[str, Any]]:
    with engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert isinstance(outs, list)
        pieces = engine.runner.piecewise
        for out in outs:
            out["replays"] = pieces.num_replays if pieces is not None else 0
        return outs


@pytest.mark.parametrize(
    ("max_tokens", "kwargs"),
    [
        (512, {}),
        (64, {"chunked_prefill_size": 48}),
        (64, {"chunked_prefill_size": 48, "page_size": 16}),
    ],
    ids=["whole-prompts", "chunked-mixed-and-eager", "pages"],
)
def test_pieces_equal_eager_and_hugging_face(
    tiny_dir: Path, vocab: int, max_tokens: int, kwargs: dict[str, Any]
) -> None:
    prompts = make_prompts(vocab, [5, 130, 3, 47, 1, 300], seed=max_tokens)
    params = greedy_params(MAX_NEW)
    pieces = _generate(_engine(tiny_dir, max_tokens, **kwargs), prompts, params)
    eager = _generate(_engine(tiny_dir, 0, **kwargs), prompts, params)
    assert [o["output_ids"] for o in pieces] == [o["output_ids"] for o in eager]
    assert pieces[0]["replays"] > 0 and eager[0]["replays"] == 0
    refs = hf_greedy(tiny_dir, prompts, MAX_NEW, "cuda")
    for out, ref in zip(pieces, refs, strict=True):
        assert_matches_reference(out["output_ids"], ref)


def test_prompt_logprobs_through_the_pieces(tiny_dir: Path, vocab: int) -> None:
    prompts = make_prompts(vocab, [40, 9], seed=3)
    params = {"max_new_tokens": 2, "temperature": 0, "return_logprob": True}
    params["logprob_start_len"] = 1
    pieces = _generate(_engine(tiny_dir, 512), prompts, params)
    eager = _generate(_engine(tiny_dir, 0), prompts, params)
    assert pieces[0]["replays"] > 0
    for got, want in zip(pieces, eager, strict=True):
        assert got["output_ids"] == want["output_ids"]
        a, b = got["meta_info"]["input_token_logprobs"], want["meta_info"]["input_token_logprobs"]
        assert [t for _, t in a] == [t for _, t in b]
        for (x, _), (y, _) in zip(a[1:], b[1:], strict=True):
            assert x == pytest.approx(y, abs=1e-4)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_half_precision_first_tokens(half_dir: Path, vocab: int, backend: str) -> None:
    """bf16 (FlashInfer's prefill with `auto` where installed): the pieces pad the GEMMs'
    rows, so cuBLAS may sum in another order; each prompt's first-token log-probabilities
    over the top 5 agree within bf16's spread."""
    prompts = make_prompts(vocab, [7, 60, 200, 33], seed=11)
    params = {"max_new_tokens": 1, "temperature": 0, "return_logprob": True}
    params["top_logprobs_num"] = 5
    options = {"dtype": "bfloat16", "attention_backend": backend}
    pieces = _generate(_engine(half_dir, 512, **options), prompts, params)
    eager = _generate(_engine(half_dir, 0, **options), prompts, params)
    assert pieces[0]["replays"] > 0
    for got, want in zip(pieces, eager, strict=True):
        # (token, logprob) pairs of the first output position
        top_got = dict(got["meta_info"]["output_top_logprobs"][0])
        top_want = dict(want["meta_info"]["output_top_logprobs"][0])
        for token in top_got.keys() & top_want.keys():
            assert top_got[token] == pytest.approx(top_want[token], abs=0.05)
        assert len(top_got.keys() & top_want.keys()) >= 4


def test_shutdown_destroys_graphs_a_caller_still_holds(tiny_dir: Path, vocab: int) -> None:
    """Under tensor parallelism a live graph holding an all-reduce made the group's
    teardown wait forever; shutdown now destroys the graphs whoever holds them."""
    engine = _engine(tiny_dir, 64)
    pieces, graphs = engine.runner.piecewise, engine.runner.graphs
    assert pieces is not None and graphs is not None
    prompts = make_prompts(vocab, [5, 9], seed=3)
    engine.generate(input_ids=prompts, sampling_params=greedy_params(4))
    assert pieces.num_replays > 0 and graphs.num_replays > 0
    engine.shutdown()
    assert not pieces._graphs and not graphs._graphs
    assert graphs.max_bs == 0 and pieces.max_tokens == 0  # nothing runs on them now


def test_pieces_and_decode_graphs_share_one_capture_stream(tiny_dir: Path) -> None:
    """The runner captures the pieces, then the decode graphs, on one stream: a stream
    each (or the decode graphs first) leaves the decode graphs' Triton kernels launching
    plainly instead of as programmatic dependents (lab/notebook/2026-11-28-h200-first-requests-each-kind-after.md, the slow state)."""
    engine = _engine(tiny_dir, 64)
    with engine:
        pieces, graphs = engine.runner.piecewise, engine.runner.graphs
        assert pieces is not None and graphs is not None
        assert pieces.capture_stream is graphs.capture_stream


def test_flashinfer_side_work_runs_on_the_capture_stream(half_dir: Path) -> None:
    """A mixed step's cascade rows run beside FlashInfer's prefill on the capture stream,
    idle after start-up: on a stream made after the decode graphs' capture they left the
    graphs' Triton kernels launching plainly (lab/notebook/2026-11-28-h200-first-requests-each-kind-after.md, the slow state)."""
    pytest.importorskip("flashinfer")
    engine = _engine(half_dir, 64, dtype="bfloat16", attention_backend="auto")
    with engine:
        graphs = engine.runner.graphs
        assert graphs is not None
        prefill = getattr(engine.runner.attn, "prefill", engine.runner.attn)
        assert prefill.name == "flashinfer"
        assert prefill._side_stream() is graphs.capture_stream
