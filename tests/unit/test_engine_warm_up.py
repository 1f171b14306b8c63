"""The start-up passes that build kernels before the first request (on CUDA the runner
runs them; here they are called on the CPU engine): they touch the reserved KV slot 0
only, and leave the engine generating what a fresh one does."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve import Engine
from tests.unit.engine_helpers import engine_outputs, make_prompts

OPTIONS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}


def test_prefill_warm_up_writes_only_slot_zero(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), **OPTIONS) as engine:
        runner = engine.runner
        prompts = make_prompts(runner.vocab_size, [9, 30, 4], seed=7)
        expected = engine_outputs(engine, prompts, 8)  # some slots now hold KV
        pool = runner.kv_pool
        before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
        runner._warm_up_prefill()
        after = pool.k_buffers + pool.v_buffers
        for old, new in zip(before, after, strict=True):
            assert torch.equal(old[1:], new[1:])  # every slot but the reserved one
        assert any(not torch.equal(old[0], new[0]) for old, new in zip(before, after, strict=True))
        engine.flush_cache()
        assert engine_outputs(engine, prompts, 8) == expected
