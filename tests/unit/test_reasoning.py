"""Reasoning split from content (`<think>` ... `</think>`), whole and streamed, for the
qwen3 and deepseek-r1 formats, against hand-written expectations; any split of a stream
gives what the whole answer does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api.reasoning import (
    REASONING_FORMATS,
    ReasoningStream,
    split_reasoning,
)

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek-r1"]


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (QWEN3, "<think>\nLet me add.\n</think>\n\n4", ("Let me add.", "4")),
        (QWEN3, "  <think>a</think>b", ("a", "b")),
        (QWEN3, "<think>\n\n</think>\n\nHi", (None, "Hi")),  # thinking switched off
        (QWEN3, "Hi, no thinking here </think> x", (None, "Hi, no thinking here </think> x")),
        (QWEN3, "<think>cut short", ("cut short", "")),
        (R1, "Let me add.\n</think>\n\n4", ("Let me add.", "4")),
        (R1, "<think>again</think>4", ("again", "4")),
        (R1, "never closed", ("never closed", "")),
        (R1, "</think>only content", (None, "only content")),
    ],
)
def test_split(fmt: object, text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, fmt) == expected  # type: ignore[arg-type]


def _stream(fmt: object, pieces: list[str]) -> tuple[list[str], list[str]]:
    stream = ReasoningStream(fmt)  # type: ignore[arg-type]
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return [*reasoning, r], [*content, c]


def test_streamed_reasoning_and_content_come_as_soon_as_known() -> None:
    reasoning, content = _stream(QWEN3, ["<th", "ink>\nStep one", ". </thi", "nk>\n\nDone", "."])
    assert reasoning[:3] == ["", "Step one", ". "]  # "<th" held, then "</thi" held
    assert content == ["", "", "", "Done", ".", ""]
    reasoning, content = _stream(QWEN3, ["Hel", "lo"])  # no thinking: content at once
    assert content[:2] == ["Hel", "lo"] and not any(reasoning)
    reasoning, content = _stream(R1, ["Think", "ing</think>", "Answer"])
    assert reasoning[:2] == ["Think", "ing"] and content[2] == "Answer"


_PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", " ", "\n", "x y", "<"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=6))
def test_any_split_of_a_stream_gives_the_whole_answers_parts(
    parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    for fmt in (QWEN3, R1):
        want_reasoning, want_content = split_reasoning(text, fmt)
        reasoning, content = _stream(fmt, pieces)
        assert "".join(reasoning).strip() == (want_reasoning or ""), (fmt.name, pieces)
        assert "".join(content).strip() == want_content.strip(), (fmt.name, pieces)
