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

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve import Engine
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode, SharedPrefix
from radixserve.engine.graphs.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from radixserve.engine.request import Req
from radixserve.engine.sched import scheduler as scheduler_module
from radixserve.engine.sched.scheduler import Scheduler
from tests.helpers.batches import PagedRequests
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda
from tests.unit.engine_helpers import engine_outputs, greedy_params, make_prompts

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
    options: dict[str, object] = {
        "device": DEVICE,
        "dtype": "float32",
        "attention_backend": "triton",
        "max_total_tokens": 512,
        "disable_cuda_graph": True,  # on CUDA too: the test installs its own runner
        **kwargs,
    }
    return Engine(model_path=str(model_dir), **options)


def _static_runner(engine: Engine, max_bs: int, cascade: bool = False) -> CudaGraphRunner:
    runner = engine.runner
    graphs = CudaGraphRunner(
        runner.model,
        runner.attn,
        runner.kv_pool,
        runner.req_pool,
        max_bs,
        capture=False,
        cascade=cascade,
    )
    runner.graphs = graphs
    return graphs


def _eager_logits(engine: Engine, batch: ForwardBatch) -> torch.Tensor:
    with torch.inference_mode():
        engine.runner.attn.init_forward_metadata(batch)
        return engine.runner.model(batch, engine.runner.attn)


@pytest.mark.slow
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


@pytest.mark.slow
def test_generation_through_the_static_pass_equals_eager(tiny_llama_dir: Path) -> None:
    prompts = make_prompts(1000, [5, 9, 3], seed=4)
    eager = engine_outputs(_engine(tiny_llama_dir), prompts, 5)
    engine = _engine(tiny_llama_dir, debug_check_invariants=True)
    graphs = _static_runner(engine, max_bs=4)  # 3 decoders run on the graph of 4
    assert engine_outputs(engine, prompts, 5) == eager
    assert graphs.num_replays > 0


def _share_prefix(reqs: PagedRequests, leader: int, length: int) -> int:
    """A new request whose first `length` KV slots are `leader`'s (a radix-cache hit)."""
    row = reqs.new_request()
    table = reqs.req_pool.req_to_token
    table[row, :length] = table[leader, :length]
    reqs.kv_lens[row] = length
    return row


@pytest.mark.slow
def test_cascade_replay_equals_the_plain_pass(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, max_total_tokens=2048)
    graphs = _static_runner(engine, max_bs=16, cascade=True)
    assert graphs.cascade_sizes == [8, 16]
    assert not graphs.runs_cascade(4) and graphs.runs_cascade(5) and graphs.runs_cascade(16)
    reqs = PagedRequests(engine.runner.kv_pool, engine.runner.req_pool)
    system_a, system_b, *own = make_prompts(1000, [70, 66, 3, 9, 1, 5, 12, 4, 7, 2, 6], seed=5)
    leaders = [reqs.new_request(), reqs.new_request()]
    _eager_logits(
        engine,
        reqs.build(ForwardMode.EXTEND, [(leaders[0], system_a), (leaders[1], system_b)]),
    )
    group_a = [leaders[0], *(_share_prefix(reqs, leaders[0], 70) for _ in range(3))]
    group_b = [leaders[1], *(_share_prefix(reqs, leaders[1], 66) for _ in range(2))]
    solo = [reqs.new_request() for _ in range(2)]
    rows = group_a + group_b + solo
    # Everyone adds tokens of its own past the shared prefix (the leaders too).
    _eager_logits(engine, reqs.build(ForwardMode.EXTEND, list(zip(rows, own, strict=False))))
    order = [4, 0, 7, 2, 5, 8, 1, 6, 3]  # members scattered through the batch
    rows = [rows[i] for i in order]
    where = {orig: pos for pos, orig in enumerate(order)}
    a = SharedPrefix(70, tuple(sorted(where[i] for i in range(4))))
    b = SharedPrefix(66, tuple(sorted(where[i] for i in range(4, 7))))
    # 9 requests on the cascade graph of 16 (two groups at most there: both run); then 9
    # again with group b alone; then 6 on the graph of 8, which holds one group: b (the
    # smaller saving) reads its prefix as plain requests do.
    steps = [(rows, (a, b)), (rows, (b,)), (rows[:6], (a, b))]
    for step, (batch_rows, groups) in enumerate(steps):
        batch = reqs.build(ForwardMode.DECODE, [(row, [11 + step]) for row in batch_rows])
        if len(batch_rows) == 6:
            groups = tuple(
                SharedPrefix(g.length, tuple(i for i in g.members if i < 6)) for g in groups
            )
        with torch.inference_mode():
            replayed = engine.runner.forward(replace(batch, shared_prefixes=groups)).clone()
        plain = _eager_logits(engine, batch)
        torch.testing.assert_close(replayed, plain, rtol=1e-4, atol=1e-4)
    assert graphs.num_replays == 3


@pytest.mark.slow
def test_generation_with_cascade_graphs_equals_the_torch_backend(tiny_llama_dir: Path) -> None:
    # Four prompts over one 72-token system prompt and two unrelated ones: their decode
    # steps (6 requests, the graph of 8) replay the cascade variant.
    system, *questions = make_prompts(1000, [72, 5, 9, 3, 12, 30, 7], seed=6)
    prompts = [system + q for q in questions[:4]] + questions[4:]
    reference = engine_outputs(_engine(tiny_llama_dir, attention_backend="torch"), prompts, 6)
    engine = _engine(tiny_llama_dir, debug_check_invariants=True)
    graphs = _static_runner(engine, max_bs=8, cascade=True)
    assert engine_outputs(engine, prompts, 6) == reference
    assert engine.scheduler.total_cascade_steps >= 4
    assert graphs.num_replays >= 4


@pytest.mark.slow
def test_cascade_groups_are_reused_only_while_the_decode_batch_keeps_its_members(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Five prompts over one system prompt, ending after 3 to 9 tokens: the decode batch
    # loses a member every few steps. Without graphs every decode step runs cascade
    # eagerly; each step's groups must equal those found afresh from the radix paths.
    system, *questions = make_prompts(1000, [72, 5, 9, 3, 12, 7], seed=7)
    prompts = [system + q for q in questions]
    lengths = [3, 9, 5, 9, 7]
    params = [greedy_params(n) for n in lengths]
    reference = _engine(tiny_llama_dir, attention_backend="torch").generate(
        input_ids=prompts, sampling_params=params
    )
    engine = _engine(tiny_llama_dir, debug_check_invariants=True)
    searches = []
    real_find = scheduler_module.find_shared_prefixes
    monkeypatch.setattr(
        scheduler_module,
        "find_shared_prefixes",
        lambda paths: searches.append(len(paths)) or real_find(paths),
    )
    steps = []
    real_groups = Scheduler._shared_prefixes

    def checked(self: Scheduler, reqs: list[Req]) -> tuple[SharedPrefix, ...]:
        groups = real_groups(self, reqs)
        lead = next(
            (i for i, r in enumerate(reqs) if r.extend_len != 1 or not r.prefill_done), len(reqs)
        )
        fresh = (
            real_find([self.kv.cache.path(r.last_node) for r in reqs[:lead]]) if lead > 1 else ()
        )
        assert groups == fresh
        steps.append(lead)
        return groups

    monkeypatch.setattr(Scheduler, "_shared_prefixes", checked)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference]
    assert [len(o["output_ids"]) for o in outs] == lengths
    # Searched only when the members changed: fewer searches than cascade steps.
    assert engine.scheduler.total_cascade_steps >= 6
    assert 0 < len(searches) < engine.scheduler.total_cascade_steps
    assert len(set(steps)) >= 3  # the batch shrank at least twice


@pytest.mark.slow
def test_cascade_steps_through_retraction_equal_the_torch_backend(tiny_llama_dir: Path) -> None:
    # A pool that holds the shared system prompt and only some of the questions and
    # outputs: requests are retracted and come back; their cascade groups are searched
    # again (a request back from retraction may hold other slots).
    system, *questions = make_prompts(1000, [72, 9, 12, 10, 11, 13, 8], seed=8)
    prompts = [system + q for q in questions]
    options = {"max_total_tokens": 130, "chunked_prefill_size": 32}
    reference = engine_outputs(_engine(tiny_llama_dir, attention_backend="torch"), prompts, 12)
    engine = _engine(tiny_llama_dir, debug_check_invariants=True, **options)
    assert engine_outputs(engine, prompts, 12) == reference
    assert engine.scheduler.total_retractions > 0, "the pool was meant to force retraction"
    assert engine.scheduler.total_cascade_steps > 0
