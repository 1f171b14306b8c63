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
