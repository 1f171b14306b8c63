"""Reasoning split from content (`<think>` ... `</think>`), whole and streamed, for the
qwen3 and deepseek-r1 formats, against hand-written expectations; any split of a stream
gives what the whole answer does. The reasoning tokens of an answer (usage's
`reasoning_tokens`), counted from its deltas, against a count made token by token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.chat_format.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
    ReasoningTokens,
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


# -- reasoning tokens -------------------------------------------------------------------


def _count(fmt: ReasoningFormat, deltas: list[list[str]]) -> int:
    """The reasoning tokens of an answer fed as `deltas`, each the texts of its tokens."""
    counter = ReasoningTokens(fmt)
    for i, texts in enumerate(deltas):
        counter.feed("".join(texts), len(texts), last=i == len(deltas) - 1)
    return counter.count


def _token_by_token(fmt: ReasoningFormat, tokens: list[str]) -> int:
    """The count by the rules, written apart from ReasoningStream: the tokens up to the one
    whose text completes the closing tag; all of them when it never comes; none for an
    answer without reasoning (one that does not open with the tag, where the prompt did
    not open it)."""
    if not fmt.starts_inside and not "".join(tokens).lstrip().startswith(fmt.start):
        return 0
    seen = ""
    for position, token in enumerate(tokens):
        seen += token
        if fmt.end in seen:
            return position + 1
    return len(tokens)


@pytest.mark.parametrize(
    ("fmt", "tokens", "expected"),
    [
        (QWEN3, ["<think>", "\n", "Let", " me", " add", ".\n", "</think>", "\n\n", "4"], 7),
        (QWEN3, ["  ", "<th", "ink>", "a", "</", "think", ">", "b"], 7),  # tags in pieces
        (QWEN3, ["<think>", "cut", " short"], 3),  # never closed
        (QWEN3, ["Hi", " no", " thinking", " </think>", " x"], 0),  # no reasoning
        (QWEN3, [" ", "<th"], 0),  # only part of the opening tag came
        (QWEN3, [], 0),
        (R1, ["Let", " me", " add", "</think>", "\n\n", "4"], 4),
        (R1, ["<think>", "again", "</think>", "4"], 3),  # the opening tag repeated
        (R1, ["never", " closed"], 2),
        (R1, ["</think>", "only", " content"], 1),
        (R1, ["<th"], 1),  # cut short on a partial tag: still inside the reasoning
    ],
)
def test_reasoning_tokens_one_token_a_delta(
    fmt: ReasoningFormat, tokens: list[str], expected: int
) -> None:
    assert _count(fmt, [[t] for t in tokens]) == expected
    assert _token_by_token(fmt, tokens) == expected


def test_a_delta_with_tokens_from_both_sides_of_the_closing_tag_counts_whole() -> None:
    # The detokenizer held "</think>" back with what came after it: one delta of 3 tokens.
    assert _count(QWEN3, [["<think>"], ["a"], ["</think>", "\n\n", "4"], ["."]]) == 5
    assert _count(R1, [["a", "</think>", "4"], ["."]]) == 3
    # Tokens whose text was held back count where the stream stands (here: reasoning).
    counter = ReasoningTokens(QWEN3)
    for text, tokens in [("<think>", 1), ("", 1), ("\u00e9", 1), ("</think>", 1), ("4", 1)]:
        counter.feed(text, tokens)
    assert counter.count == 4


_TOKENS = st.sampled_from(
    ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", "a", " ", "\n", "x y", ">\n\n"]
)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(_TOKENS, max_size=14), cuts=st.lists(st.integers(0, 14), max_size=6))
def test_any_split_into_deltas_counts_as_token_by_token(tokens: list[str], cuts: list[int]) -> None:
    """Split anywhere, the count is the token-by-token one, except that the delta holding
    the closing token counts whole (exact when a delta ends with that token)."""
    bounds = sorted({min(c, len(tokens)) for c in cuts})
    ends = [*bounds, len(tokens)]
    deltas = [tokens[a:b] for a, b in zip([0, *bounds], ends, strict=True)]
    for fmt in (QWEN3, R1):
        exact = _token_by_token(fmt, tokens)
        assert _count(fmt, [[t] for t in tokens]) == exact, fmt.name
        expected = 0 if exact == 0 else min(end for end in ends if end >= exact)
        assert _count(fmt, deltas) == expected, (fmt.name, deltas)
        if exact in (0, *ends):
            assert _count(fmt, deltas) == exact
