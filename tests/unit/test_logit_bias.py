"""OpenAI's `logit_bias`: greedy tokens of the engine with a bias equal transformers'
generate with the same bias (`sequence_bias` of one-token sequences) on the same
weights; the sampler with a bias draws what it draws from logits the bias was added to;
bad biases are refused naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.engine.sampling import SamplingBatch, SamplingRequest
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sampling.sampler import sample
from tests.unit.engine_helpers import (
    assert_matches_reference,
    greedy_params,
    hf_greedy,
    make_prompts,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(str(tiny_llama_dir), device="cpu", dtype="float32", max_total_tokens=4096)


@pytest.mark.slow
def test_greedy_tokens_with_a_bias_match_transformers(engine: Engine, tiny_llama_dir: Path) -> None:
    prompts = make_prompts(engine.runner.vocab_size, [9, 23], seed=4)
    plain = hf_greedy(tiny_llama_dir, prompts, 8)
    for prompt, ref in zip(prompts, plain, strict=True):
        # Ban the token greedy picks first and favour an arbitrary one a little.
        bias = {ref.tokens[0]: -100.0, 321: 4.0}
        want = hf_greedy(tiny_llama_dir, [prompt], 8, logit_bias=bias)[0]
        assert want.tokens != ref.tokens  # the bias changes the answer
        params = {**greedy_params(8), "logit_bias": {str(t): b for t, b in bias.items()}}
        out = engine.generate(input_ids=prompt, sampling_params=params)
        assert isinstance(out, dict)
        assert ref.tokens[0] not in out["output_ids"][:1]
        assert_matches_reference(out["output_ids"], want)


def _request(**params: object) -> SamplingRequest:
    return SamplingRequest(SamplingParams(**params), seed=7, output_ids=[4])  # type: ignore[arg-type]


def test_the_sampler_adds_the_bias_before_it_chooses() -> None:
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    biases = [{5: 30.0, 6: -2.5}, None, {int(logits[2].argmax()): -100.0}]
    reqs = [
        _request(temperature=0.0, logit_bias=biases[0]),
        _request(temperature=0.8, top_p=0.9),
        _request(temperature=0.7, logit_bias=biases[2]),
    ]
    dense = torch.zeros_like(logits)
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            dense[row, token] = value
    with_bias = sample(logits, SamplingBatch.build(reqs, vocab, "cpu"))
    unbiased = [
        SamplingRequest(dataclasses.replace(r.params, logit_bias=None), seed=7, output_ids=[4])
        for r in reqs
    ]
    reference = sample(logits + dense, SamplingBatch.build(unbiased, vocab, "cpu"))
    assert with_bias.next_token_ids.tolist() == reference.next_token_ids.tolist()
    assert with_bias.next_token_ids[0] == 5


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ({"-1": 1.0}, r"ids must be in \[0, "),
        ({"10": 101.0}, r"values must be in \[-100, 100\]"),
        ({"ten": 1.0}, "keys must be token ids"),
        ({"10": "high"}, "'logit_bias' must be"),
    ],
)
def test_bad_biases_are_refused(engine: Engine, bias: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(input_ids=[5, 6, 7], sampling_params={"logit_bias": bias})
