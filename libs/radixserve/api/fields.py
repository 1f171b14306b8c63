"""The type and range of every sampling field of the HTTP bodies, declared once.

The request models (`openai_models`, `native_models`) annotate their fields with these,
so the OpenAI name (`max_tokens`) and the SGLang name (`max_new_tokens`) of one
parameter share one rule. The ranges mirror the engine's
(`engine.sampling.params.SamplingParams.validate`), which the gateway does not import
(it would pull in torch): a body the gateway accepts is one the engine accepts, and
the client hears about a bad value from the gateway, with `param`, at once.

Rules that relate two fields (min_tokens <= max_tokens, one grammar at most) live in
`mapping`, where both values are known; the bounds a server may configure (n, max_tokens,
stop strings, grammar sizes, ...) in `limits`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# The engine's MAX_TOP_LOGPROBS; OpenAI's chat `top_logprobs` has the same bound.
MAX_TOP_LOGPROBS = 20
# OpenAI's legacy completions `logprobs` takes at most 5.
MAX_COMPLETION_LOGPROBS = 5
# SGLang's `priority` (higher is admitted first), bounded so no client outbids every
# other by an arbitrary margin; the gateway may clamp it further per API key.
MIN_PRIORITY = -1_000_000
MAX_PRIORITY = 1_000_000


def _top_k_rule(value: int) -> int:
    if value != -1 and value < 1:
        raise ValueError("must be -1 (no top-k) or >= 1")
    return value


MaxTokens = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, AfterValidator(_top_k_rule)]
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # frequency_penalty, presence_penalty
RepetitionPenalty = Annotated[float, Field(gt=0, le=2)]
NumChoices = Annotated[int, Field(ge=1)]  # the upper bound is `RequestLimits.max_n`
# Whatever fits a 64-bit seed, signed or not (torch takes both).
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
# Token ids travel as packed int32; the tokenizer checks them against the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TopLogprobsNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStartLen = Annotated[int, Field(ge=-1)]  # -1: no prompt logprobs
CompletionLogprobs = Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)]
# A bare string or a list of them; normalised to a list by `mapping`.
Stop = str | list[str]
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class Body(BaseModel):
    """Base of every request model.

    `strict`: "0.7" is not a number and 1 is not a boolean (OpenAI's server agrees);
    an int is still a fine float. `extra="ignore"`: unknown fields are ignored, as
    OpenAI's server does. NaN and infinity compare false against every range, so
    they are refused outright.
    """

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class SGLangSamplingFields(Body):
    """SGLang's sampling extras, accepted in the OpenAI bodies under SGLang's names
    (`min_tokens` is OpenAI-style naming for SGLang's `min_new_tokens`)."""

    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MaxTokens | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's structural tag as JSON text
