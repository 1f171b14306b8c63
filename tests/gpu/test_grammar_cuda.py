"""Structured outputs on CUDA: the bitmask applied on the device with xgrammar's kernel
gives the same tokens as on the CPU, and constrained outputs stay valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve import Engine
from tests.helpers.structured_cases import JSON_SCHEMAS, REGEXES, check_json, check_regex
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_grammar_gpu"), seed=0))


def test_constrained_outputs_on_cuda_match_the_cpu(tiny_dir: Path) -> None:
    cases = [{"json_schema": json.dumps(s), "max_new_tokens": 256} for s in JSON_SCHEMAS[::3]]
    cases += [{"regex": p, "max_new_tokens": 64} for p in list(REGEXES.values())[::2]]
    params = [{"temperature": 0.0, **c} for c in cases]
    prompts = [f"Answer {i}:" for i in range(len(params))]
    outputs = {}
    for device in ("cuda", "cpu"):
        engine = Engine(model_path=str(tiny_dir), device=device, dtype="float32")
        outs = engine.generate(prompt=prompts, sampling_params=params)
        assert isinstance(outs, list)
        outputs[device] = [o["text"] for o in outs]
        engine.shutdown()
    for case, text in zip(cases, outputs["cuda"], strict=True):
        if "json_schema" in case:
            check_json(text, json.loads(case["json_schema"]))
        else:
            check_regex(text, case["regex"])
    assert outputs["cuda"] == outputs["cpu"]


def test_warm_up_builds_the_mask_kernel_the_steps_then_use() -> None:
    """xgrammar's Triton mask kernel is built at start-up (constrained/logits.warm_up) for
    the row counts a step has: a step of 1, 3, 16 or 40 constrained rows builds none."""
    import torch
    import xgrammar as xgr
    from xgrammar.kernels import apply_token_bitmask_inplace_triton as kernels

    from radixserve.engine.constrained import logits as grammar_logits

    def compiled() -> int:
        caches = kernels.apply_token_bitmask_inplace_kernel.device_caches.values()
        return sum(len(c[0]) for c in caches)

    device = torch.device("cuda")
    vocab = 32064  # no other test here uses it: its variants are not built yet
    before = compiled()
    grammar_logits.warm_up(vocab, device)
    warmed = compiled()
    assert warmed > before
    for rows in (1, 3, 16, 40):
        logits = torch.randn(rows + 2, vocab, device=device)
        bitmask = xgr.allocate_token_bitmask(rows + 2, vocab)
        bitmask[:, ::2] = 0  # bans tokens 0-31, 64-95, ...
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(device), vocab_size=vocab, indices=list(range(rows))
        )
        banned = torch.arange(vocab, device=device).div(32, rounding_mode="floor") % 2 == 0
        assert torch.isinf(logits[:rows, banned]).all()
        assert not torch.isinf(logits[rows:]).any()
    assert compiled() == warmed
