"""Request body of the native `POST /generate` (SGLang's `GenerateReqInput` subset).

`sampling_params` uses SGLang's field names and, like SGLang, refuses a key it does
not know: a misspelt `max_tokens` there would otherwise silently run 128 tokens.
"""

from __future__ import annotations

from pydantic import ConfigDict

from radixserve.api.fields import (
    Body,
    LogprobStartLen,
    MaxTokens,
    MinP,
    NumChoices,
    Penalty,
    Priority,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TokenId,
    TopK,
    TopLogprobsNum,
    TopP,
)


class GenerateSamplingParams(Body):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: MaxTokens | None = None
    min_new_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    n: NumChoices | None = None
    seed: Seed | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> [-100, 100]


class GenerateRequest(Body):
    """Exactly one of `text` / `input_ids` (a list of them is a batch)."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: TopLogprobsNum | None = None
    # With return_logprob: the prompt tokens' logprobs from this position on (-1: none).
    logprob_start_len: LogprobStartLen | None = None
    priority: Priority | None = None  # higher is admitted first (default 0)
