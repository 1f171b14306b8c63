"""OpenAI's `logit_bias` through the whole stack, driven with the `openai` client: the
answer equals the in-process engine's with the same bias on the same weights, and an
id outside the vocabulary is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from radixserve import Engine
from tests.integration.stack_fixture import RunningStack

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"


@pytest.fixture()
def client(tiny_stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_stack.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_bias_changes_the_answer_as_it_does_in_process(
    client: openai.OpenAI, tiny_stack: RunningStack, tiny_engine: Engine
) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 8}
    plain = tiny_engine.generate(PROMPT, greedy)
    assert isinstance(plain, dict)
    first = plain["output_ids"][0]
    bias = {first: -100.0, 1234: 5.0}
    expected = tiny_engine.generate(PROMPT, {**greedy, "logit_bias": bias})
    assert isinstance(expected, dict) and expected["output_ids"][0] != first
    got = client.completions.create(
        model=tiny_stack.model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        logit_bias={str(t): b for t, b in bias.items()},
    )
    assert got.choices[0].text == expected["text"]
    assert got.usage is not None and got.usage.completion_tokens == len(expected["output_ids"])


def test_an_id_outside_the_vocabulary_is_a_400(
    client: openai.OpenAI, tiny_stack: RunningStack, tiny_engine: Engine
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=tiny_stack.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            logit_bias={str(tiny_engine.runner.vocab_size): 1.0},
        )
    assert info.value.param == "logit_bias"
