"""Prompt logprobs through the whole stack (real NATS and Redis, the six services):
`/generate` with `logprob_start_len` and `/v1/completions` with `echo` + `logprobs`
(OpenAI's prompt scoring, what evaluation harnesses use) give the in-process engine's
prompt logprobs on the same weights, streamed or not."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from radixserve import Engine
from tests.integration.stack_fixture import RunningStack

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox jumps over the lazy dog, then naps."


def _engine_scores(engine: Engine, ids: list[int], start: int, top: int = 0) -> dict[str, Any]:
    params = {
        "max_new_tokens": 1,
        "temperature": 0,
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": top,
    }
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict)
    return dict(out["meta_info"])


def test_generate_reports_the_engines_prompt_logprobs(
    tiny_stack: RunningStack, tiny_engine: Engine
) -> None:
    ids = tiny_engine.tokenizer.encode(PROMPT)
    expected = _engine_scores(tiny_engine, ids, 0, top=2)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    response = httpx.post(f"{tiny_stack.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [tok for _, tok, _ in got] == ids
    assert got[0][0] is None and meta["input_top_logprobs"][0] is None
    for (lp, _, text), (want, tok) in zip(
        got[1:], expected["input_token_logprobs"][1:], strict=True
    ):
        assert lp == pytest.approx(want, abs=1e-4)
        assert text == tiny_engine.tokenizer.decode([tok])
    tops = [[t for _, t, _ in row] for row in meta["input_top_logprobs"][1:]]
    assert tops == [[t for t, _ in row] for row in expected["input_top_logprobs"][1:]]
    bad = httpx.post(
        f"{tiny_stack.url}/generate", json={**body, "logprob_start_len": -2}, timeout=30
    )
    assert bad.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_scores_the_prompt(
    tiny_stack: RunningStack, tiny_engine: Engine, stream: bool
) -> None:
    ids = tiny_engine.tokenizer.encode(PROMPT)
    expected = [lp for lp, _ in _engine_scores(tiny_engine, ids, 0)["input_token_logprobs"]]
    client = openai.OpenAI(base_url=f"{tiny_stack.url}/v1", api_key="x", max_retries=0, timeout=120)
    kwargs: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    kwargs.update(echo=True, logprobs=1, model=tiny_stack.model)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    text = ""
    if stream:
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    token_logprobs += choice.logprobs.token_logprobs or []
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text = choice.text
        assert choice.logprobs is not None
        tokens = choice.logprobs.tokens or []
        token_logprobs = choice.logprobs.token_logprobs or []
    assert text.startswith(PROMPT)
    assert len(tokens) == len(ids) + 2  # the prompt's tokens, then the completion's
    assert token_logprobs[0] is None
    assert token_logprobs[1 : len(ids)] == pytest.approx(expected[1:], abs=1e-4)
    assert all(isinstance(lp, float) for lp in token_logprobs[1:])


def test_scoring_alone_with_max_tokens_zero(tiny_stack: RunningStack, tiny_engine: Engine) -> None:
    """What evaluation harnesses send for a log-likelihood: echo, logprobs, no new token."""
    ids = tiny_engine.tokenizer.encode(PROMPT)
    expected = [lp for lp, _ in _engine_scores(tiny_engine, ids, 0)["input_token_logprobs"]]
    client = openai.OpenAI(base_url=f"{tiny_stack.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(
        model=tiny_stack.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert out.usage is not None and out.usage.completion_tokens == 0
