"""A reasoning model's answers through the whole stack (gateway --reasoning-parser qwen3),
driven with the `openai` client: the reasoning comes apart as `reasoning_content`,
streamed or not, and `separate_reasoning: false` gives the text as the engine wrote it.
The tiny random model is steered to a reasoning model's shape with the `regex`
extension; the text is compared with the in-process engine's under the same regex."""

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


def test_reasoning_comes_apart_streamed_or_not(stack: RunningStack, tiny_engine: Engine) -> None:
    expected = tiny_engine.chat(USER, {"temperature": 0, "max_new_tokens": 48, "regex": THINKING})[
        "text"
    ]
    reasoning, answer = expected.split("</think>")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
    common: dict[str, Any] = {
        "model": stack.model,
        "messages": USER,
        "temperature": 0,
        "max_tokens": 48,
        "extra_body": {"regex": THINKING},
    }
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
