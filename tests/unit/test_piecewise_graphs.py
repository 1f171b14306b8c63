"""Prefill pieces (graphs/piecewise.py) run eagerly (`capture=False`) where there is no CUDA
to capture with: the padded static pass, its hand-offs through the static buffers and
the eager attention between pieces must give the eager model's logits (and prompt
logprobs), write the batch's own K/V, and touch no KV slot but the batch's and the
reserved slot 0, also after a larger pass left real rows behind. tests/gpu/
test_piecewise_cuda.py checks the captured pieces on CUDA.

Triton picks the interpreter when a kernel is defined, so the variable is set before
anything imports the kernels (as in test_cuda_graph_runner.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve import Engine
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.graphs.piecewise import PiecewiseGraphs, token_buckets
from tests.helpers.batches import PagedRequests
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda
from tests.unit.engine_helpers import engine_outputs, make_prompts

skip_unless_interpreted_or_cuda()

DEVICE = "cpu" if INTERPRETED else "cuda"


def test_token_buckets() -> None:
    assert token_buckets(512) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert token_buckets(100) == [8, 16, 32, 64, 96, 100]  # the limit itself always runs
    assert token_buckets(640) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 640]
    assert token_buckets(5) == [5]
    with pytest.raises(ValueError):
        token_buckets(0)


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    options: dict[str, object] = {
        "device": DEVICE,
        "dtype": "float32",
        "attention_backend": "triton",
        "max_total_tokens": 1024,
        "disable_cuda_graph": True,  # on CUDA too: the test installs its own pieces
        **kwargs,
    }
    return Engine(model_path=str(model_dir), **options)


def _static_pieces(engine: Engine, max_tokens: int) -> PiecewiseGraphs:
    runner = engine.runner
    pieces = PiecewiseGraphs(runner.model, runner.attn, runner.kv_pool, max_tokens, capture=False)
    runner.piecewise = pieces
    return pieces


def _eager_logits(engine: Engine, batch: ForwardBatch) -> torch.Tensor:
    with torch.inference_mode():
        engine.runner.attn.init_forward_metadata(batch)
        return engine.runner.model(batch, engine.runner.attn)


def test_padded_pieces_equal_eager_and_write_only_their_slots(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    pieces = _static_pieces(engine, max_tokens=64)
    pool = engine.runner.kv_pool
    gen = torch.Generator().manual_seed(0)
    for buffer in pool.k_buffers + pool.v_buffers:  # noise everywhere, slot 0 included
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.device))
    reqs = PagedRequests(pool, engine.runner.req_pool)
    rows = [reqs.new_request() for _ in range(4)]
    # 29 tokens (a bucket of 32), then a mixed pass of three decoders and a prefix-cached
    # extend, 9 tokens (16) after the larger pass left real rows, then 1 token (8).
    steps = [
        [(rows[0], 11), (rows[1], 13), (rows[2], 5)],
        [(rows[0], 1), (rows[1], 1), (rows[2], 1), (rows[3], 6)],
        [(rows[3], 1)],
    ]
    for step, lengths in enumerate(steps):
        prompts = make_prompts(1000, [n for _, n in lengths], seed=10 + step)
        mode = ForwardMode.EXTEND
        batch = reqs.build(
            mode, [(row, ids) for (row, _), ids in zip(lengths, prompts, strict=True)]
        )
        before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        with torch.inference_mode():
            ran = engine.runner.forward(batch).clone()
        after = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        written = torch.zeros(pool.k_buffers[0].shape[0], dtype=torch.bool)
        written[batch.out_cache_loc.cpu()] = True
        written[0] = True
        for old, new in zip(before, after, strict=True):
            changed = (old != new).flatten(1).any(1).cpu()
            assert not (changed & ~written).any(), f"step {step}: a slot outside the batch changed"
        eager = _eager_logits(engine, batch)  # rewrites the batch's slots
        assert ran.shape == eager.shape == (batch.batch_size, engine.runner.vocab_size)
        torch.testing.assert_close(ran, eager, rtol=1e-4, atol=1e-4)
        loc = batch.out_cache_loc
        for piecewise_kv, eager_kv in zip(after, pool.k_buffers + pool.v_buffers, strict=True):
            torch.testing.assert_close(piecewise_kv[loc], eager_kv[loc], rtol=1e-5, atol=1e-5)
    assert pieces.num_replays == 3
    assert [pieces.padded_size(n) for n in (29, 9, 1)] == [32, 16, 8]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_generation_through_the_pieces_equals_eager(
    tiny_llama_dir: Path, tiny_qwen3_dir: Path, model: str
) -> None:
    # Chunks of 16 beside decoders run eagerly (past 12 tokens); the shorter prefills and
    # the decode passes (no decode graphs here) through the pieces. Qwen3: q/k norms
    # inside the pieces, q/k/v/o biases, a tied head.
    model_dir = tiny_llama_dir if model == "llama" else tiny_qwen3_dir
    prompts = make_prompts(1000, [5, 40, 3, 17], seed=4)
    options = {"chunked_prefill_size": 16}
    eager = engine_outputs(_engine(model_dir, **options), prompts, 6)
    engine = _engine(model_dir, debug_check_invariants=True, **options)
    pieces = _static_pieces(engine, max_tokens=12)
    assert engine_outputs(engine, prompts, 6) == eager
    assert pieces.num_replays > 0
    # What the worker's forward_passes metric reads: the pieces' passes and the eager
    # ones past their limit (no decode graphs here).
    passes = engine.load().forward_passes
    assert passes["prefill_pieces"] == pieces.num_replays
    assert passes["eager"] > 0 and passes["decode_graph"] == 0


def test_prompt_logprobs_through_the_pieces_equal_eager(tiny_llama_dir: Path) -> None:
    (ids,) = make_prompts(1000, [30], seed=7)
    params = {"max_new_tokens": 2, "temperature": 0, "return_logprob": True}
    params["logprob_start_len"] = 3
    eager = _engine(tiny_llama_dir).generate(input_ids=ids, sampling_params=params)
    engine = _engine(tiny_llama_dir)
    pieces = _static_pieces(engine, max_tokens=32)
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict) and isinstance(eager, dict)
    assert pieces.num_replays > 0
    assert out["output_ids"] == eager["output_ids"]
    got, want = out["meta_info"]["input_token_logprobs"], eager["meta_info"]["input_token_logprobs"]
    assert [t for _, t in got] == [t for _, t in want] == ids[3:]
    for (lp, _), (ref, _) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref, abs=1e-5)
