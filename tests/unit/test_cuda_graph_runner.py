"""The CUDA graph runner's padded static pass, run eagerly (`capture=False`) where there
is no CUDA to capture with: the triton backend's capture-time metadata (tables built
on the device from the static buffers, fixed split count, fixed scratch) and the
padding rows must give the eager pass's logits and touch no KV slot but the batch's
own and the reserved slot 0, also after a larger batch left real rows behind.
tests/gpu/test_cuda_graph.py checks the captured graphs themselves on CUDA.

Triton picks the interpreter when a kernel is defined, so the variable is set before
anything imports the kernels (as in test_triton_attention.py).
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
from radixserve.engine.graphs.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from tests.helpers.batches import PagedRequests
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda
from tests.unit.engine_helpers import engine_outputs, make_prompts

skip_unless_interpreted_or_cuda()

DEVICE = "cpu" if INTERPRETED else "cuda"


def test_capture_ladder() -> None:
    assert capture_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16)]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]  # the cap itself always has a graph
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=512,
        disable_cuda_graph=True,  # on CUDA too: the test installs its own runner
        **kwargs,
    )


def _static_runner(engine: Engine, max_bs: int) -> CudaGraphRunner:
    runner = engine.runner
    graphs = CudaGraphRunner(
        runner.model, runner.attn, runner.kv_pool, runner.req_pool, max_bs, capture=False
    )
    runner.graphs = graphs
    return graphs


def _eager_logits(engine: Engine, batch: ForwardBatch) -> torch.Tensor:
    with torch.inference_mode():
        engine.runner.attn.init_forward_metadata(batch)
        return engine.runner.model(batch, engine.runner.attn)


def test_padded_replay_equals_eager_and_writes_only_its_slots(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    graphs = _static_runner(engine, max_bs=8)
    pool = engine.runner.kv_pool
    gen = torch.Generator().manual_seed(0)
    for buffer in pool.k_buffers + pool.v_buffers:  # noise everywhere, slot 0 included
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.device))
    reqs = PagedRequests(pool, engine.runner.req_pool)
    rows = [reqs.new_request() for _ in range(8)]
    prompts = make_prompts(1000, [5, 13, 20, 3, 17, 9, 1, 11], seed=2)
    _eager_logits(engine, reqs.build(ForwardMode.EXTEND, list(zip(rows, prompts, strict=True))))
    # 5 runs on the graph of 8; 3 on the graph of 4 after 8 left real rows there; 1 on
    # a graph with several KV splits.
    for bs in (5, 8, 3, 1):
        batch = reqs.build(ForwardMode.DECODE, [(row, [7 + bs]) for row in rows[:bs]])
        before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        with torch.inference_mode():
            replayed = engine.runner.forward(batch).clone()
        written = torch.zeros(pool.k_buffers[0].shape[0], dtype=torch.bool)
        written[batch.out_cache_loc.cpu()] = True
        written[0] = True
        for old, new in zip(before, pool.k_buffers + pool.v_buffers, strict=True):
            changed = (old != new).flatten(1).any(1).cpu()
            assert not (changed & ~written).any(), f"bs {bs}: a slot outside the batch changed"
        eager = _eager_logits(engine, batch)  # rewrites the same slots with the same K/V
        assert replayed.shape == eager.shape == (bs, engine.runner.vocab_size)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert graphs.num_replays == 4


def test_generation_through_the_static_pass_equals_eager(tiny_llama_dir: Path) -> None:
    prompts = make_prompts(1000, [5, 9, 3], seed=4)
    eager = engine_outputs(_engine(tiny_llama_dir), prompts, 5)
    engine = _engine(tiny_llama_dir, debug_check_invariants=True)
    graphs = _static_runner(engine, max_bs=4)  # 3 decoders run on the graph of 4
    assert engine_outputs(engine, prompts, 5) == eager
    assert graphs.num_replays > 0
