"""A reasoning model's answers through the whole stack (gateway --reasoning-parser qwen3),
driven with the `openai` client: the reasoning comes apart as `reasoning_content`,
streamed or not, and `separate_reasoning: false` gives the text as the engine wrote it;
usage's `completion_tokens_details.reasoning_tokens` counts the tokens up to the closing
tag, streamed or not, summed over choices. The tiny random model is steered to a
reasoning model's shape with the `regex` extension; the text is compared with the
in-process engine's under the same regex, the count with one made from its token ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve import Engine
from tests.integration.stack_fixture import RunningStack, tiny_running_stack

pytestmark = pytest.mark.timeout(300)

THINKING = r"<think>\nLet me see: (two|three) and two\.\n</think>\n\n(4|5)\."
USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def stack(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    log_dir = tmp_path_factory.mktemp("reasoning_logs")
    parser = {"gateway": ["--reasoning-parser", "qwen3"]}
    with tiny_running_stack(nats_url, redis_url, tiny_model_dir, log_dir, parser) as running:
        yield running


@pytest.fixture(scope="module")
def engine_answer(tiny_engine: Engine) -> dict[str, Any]:
    """The in-process engine's answer to the requests below."""
    return tiny_engine.chat(USER, {"temperature": 0, "max_new_tokens": 48, "regex": THINKING})


def _client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)


def _common(stack: RunningStack) -> dict[str, Any]:
    return {
        "model": stack.model,
        "messages": USER,
        "temperature": 0,
        "max_tokens": 48,
        "extra_body": {"regex": THINKING},
    }


def test_reasoning_comes_apart_streamed_or_not(
    stack: RunningStack, engine_answer: dict[str, Any]
) -> None:
    expected = engine_answer["text"]
    reasoning, answer = expected.split("</think>")
    client, common = _client(stack), _common(stack)
    message = client.chat.completions.create(**common).choices[0].message
    assert message.content == answer.strip()
    assert (message.model_extra or {})["reasoning_content"] == reasoning.removeprefix(
        "<think>"
    ).strip()

    thought, content = "", ""
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (thought.strip(), content.strip()) == (
        reasoning.removeprefix("<think>").strip(),
        answer.strip(),
    )

    whole = client.chat.completions.create(
        **{**common, "extra_body": {"regex": THINKING, "separate_reasoning": False}}
    )
    assert whole.choices[0].message.content == expected


def _reasoning_tokens(tiny_engine: Engine, output_ids: list[int]) -> int:
    """Where the engine's answer closes its reasoning, counted on its token ids alone: the
    position of the first token whose text (with the tokens before it) holds `</think>`,
    + 1."""
    for position in range(len(output_ids)):
        if "</think>" in tiny_engine.tokenizer.decode(output_ids[: position + 1]):
            return position + 1
    raise AssertionError("the engine's answer never closed its reasoning")


def test_reasoning_tokens_are_counted_streamed_or_not(
    stack: RunningStack, tiny_engine: Engine, engine_answer: dict[str, Any]
) -> None:
    output_ids = engine_answer["output_ids"]
    expected = _reasoning_tokens(tiny_engine, output_ids)
    assert 0 < expected < len(output_ids)  # some reasoning, then some content
    client, common = _client(stack), _common(stack)

    usage = client.chat.completions.create(**common).usage
    assert usage is not None and usage.completion_tokens == len(output_ids)
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == expected

    chunks = list(
        client.chat.completions.create(
            **common, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.completion_tokens_details is not None
    assert streamed.completion_tokens_details.reasoning_tokens == expected

    # Still reasoning when the answer does not split it out; summed over the choices.
    whole = client.chat.completions.create(
        **{**common, "n": 2, "extra_body": {"regex": THINKING, "separate_reasoning": False}}
    )
    assert [c.message.content for c in whole.choices] == [engine_answer["text"]] * 2
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 2 * expected
