"""Chat answers of a reasoning model (the gateway's --reasoning-parser): reasoning apart
from content, whole and streamed, beside tool calls; usage's reasoning tokens, whole and
streamed, summed over choices; chat_template_kwargs carried to the tokenizer; the gateway
setting read from its flag or variable."""

from __future__ import annotations

import argparse
import json
from itertools import zip_longest
from typing import Any

import pytest

from radixserve.api import ApiError, Assembly, chat_completion, make_streamer
from radixserve.api.mapping import GenerationPlan
from radixserve.protocol import FinishReason
from radixserve.services.gateway.settings import add_arguments, settings_from
from radixserve.services.runtime import add_common_arguments
from tests.unit.chat_answers import chat_plan, sse_payloads, text_delta, token_deltas

STOP = FinishReason(kind="stop")
LENGTH = FinishReason(kind="length")
USER = [{"role": "user", "content": "2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "calc"}}]


def _plan(parser: str | None = "qwen3", **fields: Any) -> GenerationPlan:
    return chat_plan({"messages": USER, **fields}, reasoning_parser=parser)


def _message(plan: GenerationPlan, text: str) -> dict[str, Any]:
    assembly = Assembly(plan)
    assembly.apply(text_delta(text, STOP))
    choice: dict[str, Any] = chat_completion(plan, assembly, 0)["choices"][0]
    return choice


def test_reasoning_is_answered_apart_from_the_content() -> None:
    text = "<think>\nTwo and two.\n</think>\n\n4"
    choice = _message(_plan(), text)
    assert choice["message"] == {
        "role": "assistant",
        "reasoning_content": "Two and two.",
        "content": "4",
    }
    # Per request off, or no parser on the gateway: the text as it came.
    for plan in (_plan(separate_reasoning=False), _plan(None)):
        assert _message(plan, text)["message"] == {"role": "assistant", "content": text}


def test_a_call_after_the_reasoning_is_a_tool_call() -> None:
    text = (
        '<think>Use the tool.</think>\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'
    )
    choice = _message(_plan(tools=TOOLS), text)
    message = choice["message"]
    assert message["reasoning_content"] == "Use the tool." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["calc"]
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_reasoning_comes_as_reasoning_content_deltas() -> None:
    plan = _plan(stream=True)
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=1)
    pieces = ["<think>", "\nTwo and", " two.</th", "ink>\n\n", "4", ""]
    deltas = []
    for i, piece in enumerate(pieces):
        update = assembly.apply(text_delta(piece, STOP if i == len(pieces) - 1 else None))
        assert update is not None
        events = sse_payloads(streamer.events(update, 0.0))
        deltas += [c["choices"][0]["delta"] for c in events]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning.strip() == "Two and two." and content == "4"
    # The reasoning went out before its end tag came.
    assert deltas.index({"reasoning_content": "Two and"}) < deltas.index({"content": "4"})


def _usage(plan: GenerationPlan, *answers: list[list[str]]) -> dict[str, Any]:
    """The body's usage once choice i answered `answers[i]` (one token a delta)."""
    assembly = Assembly(plan)
    for index, tokens in enumerate(answers):
        for delta in token_deltas([[t] for t in tokens], index):
            assembly.apply(delta)
    assert assembly.done
    usage: dict[str, Any] = chat_completion(plan, assembly, 0)["usage"]
    return usage


THOUGHT = ["<think>", "\n", "Two", " and", " two", ".\n", "</think>", "\n\n", "4"]  # 7 + 2


@pytest.mark.parametrize(
    ("parser", "tokens", "expected"),
    [
        ("qwen3", THOUGHT, 7),
        ("qwen3", ["4", "."], 0),  # thinking switched off
        ("qwen3", THOUGHT[:4], 4),  # cut short inside the reasoning
        ("deepseek-r1", THOUGHT[1:], 6),
        ("deepseek-r1", ["Two", " and"], 2),  # never closed
    ],
)
def test_usage_counts_the_reasoning_tokens(parser: str, tokens: list[str], expected: int) -> None:
    usage = _usage(_plan(parser), tokens)
    assert usage["completion_tokens"] == len(tokens)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}


def test_reasoning_tokens_without_separate_reasoning_and_without_a_parser() -> None:
    # The tokens are reasoning even when the answer does not split them out (as vLLM).
    plan = _plan(separate_reasoning=False)
    assert _usage(plan, THOUGHT)["completion_tokens_details"] == {"reasoning_tokens": 7}
    assert "completion_tokens_details" not in _usage(_plan(None), THOUGHT)


def test_reasoning_tokens_of_n_choices_are_summed_and_streamed_as_in_the_body() -> None:
    answers = [THOUGHT, ["4", "."], THOUGHT[:3]]
    plan = _plan(n=3)
    body_usage = _usage(plan, *answers)
    assert body_usage["completion_tokens_details"] == {"reasoning_tokens": 7 + 0 + 3}
    assert body_usage["completion_tokens"] == sum(len(a) for a in answers)

    streamed = _plan(n=3, stream=True, stream_options={"include_usage": True})
    assembly = Assembly(streamed)
    streamer = make_streamer(streamed, assembly, created=1)
    per_choice = [token_deltas([[t] for t in a], i, LENGTH) for i, a in enumerate(answers)]
    for delta in (d for step in zip_longest(*per_choice) for d in step if d is not None):
        update = assembly.apply(delta)
        assert update is not None
        streamer.events(update, 0.0)
    assert assembly.done
    (last,) = sse_payloads(streamer.final(assembly))
    assert last["choices"] == [] and last["usage"] == body_usage


def test_chat_template_kwargs_reach_the_tokenizer() -> None:
    plan = _plan(chat_template_kwargs={"enable_thinking": False})
    assert json.loads(plan.submits[0].chat_template_kwargs or "") == {"enable_thinking": False}
    assert _plan().submits[0].chat_template_kwargs is None
    with pytest.raises(ApiError) as info:
        _plan(chat_template_kwargs={"tokenize": True, "enable_thinking": True})
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")
    assert "tokenize" in info.value.message


def _settings(argv: list[str], environ: dict[str, str]) -> Any:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    add_arguments(parser)
    return settings_from(parser.parse_args(argv), environ)


def test_the_gateway_reads_its_reasoning_parser_from_the_flag_or_the_variable() -> None:
    assert _settings([], {}).reasoning_parser is None
    assert _settings(["--reasoning-parser", "qwen3"], {}).reasoning_parser == "qwen3"
    env = {"RADIXSERVE_REASONING_PARSER": "deepseek-r1"}
    assert _settings([], env).reasoning_parser == "deepseek-r1"
    assert _settings(["--reasoning-parser", "none"], env).reasoning_parser is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        _settings(["--reasoning-parser", "o1"], {})
