"""HTTP request bodies -> `protocol.SubmitRequest`s: defaults, normalisation, cross-field rules.

    plan = plan_chat(body, response_id=new_response_id("chat"), gateway_id=gid,
                     served_model="SmolLM2-135M-Instruct", arrival_time=time.time())
    for submit in plan.submits:
        await bus.publish(subjects.tokenize, encode(submit))

A `GenerationPlan` is everything the gateway needs to publish a request and to put
its answer together: one `SubmitRequest` per prompt (a list of prompts in
`/v1/completions` or a batch in `/generate`), and how the choices of those requests
merge (`index = prompt_index * n + choice`). Every rule that needs more than one
field lives here and raises `ApiError` with the offending `param`.

Defaults when the client sets no length: 256 new tokens for chat, 16 for
`/v1/completions` (OpenAI's legacy default), SGLang's 128 for `/generate` (each at most
`RequestLimits.max_output_tokens`). The bounds of `limits` are checked by `bounds` as
each value comes in. `priority` (SGLang's, default 0) goes into every submit; the
gateway may replace it (`with_priority`, e.g. clamped to the caller's API-key class).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from radixserve.api.bounds import (
    GRAMMAR_FIELDS,
    check_grammar,
    check_messages,
    check_output_tokens,
    check_prompts,
    check_sampling,
    check_tools,
)
from radixserve.api.chat_tools import ToolPlan, plan_tools
from radixserve.api.errors import ApiError
from radixserve.api.fields import MAX_PRIORITY, MIN_PRIORITY
from radixserve.api.limits import DEFAULT_LIMITS, RequestLimits
from radixserve.api.native_models import GenerateRequest
from radixserve.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISamplingFields,
    ResponseFormat,
)
from radixserve.api.prompts import (
    PromptInput,
    chat_messages,
    completion_prompts,
    id_prompts,
    normalize_stop,
)
from radixserve.api.response_format import RESPONSE_FORMAT_PARAM, response_format_grammar
from radixserve.chat_format.reasoning import REASONING_FORMATS, ReasoningFormat
from radixserve.protocol import (
    SamplingParams,
    SubmitRequest,
    pack_tokens,
)

Endpoint = Literal["chat", "completion", "generate"]

CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
GENERATE_DEFAULT_MAX_NEW_TOKENS = SamplingParams().max_new_tokens  # SGLang's 128

_ID_PREFIX: dict[Endpoint, str] = {"chat": "chatcmpl-", "completion": "cmpl-", "generate": ""}


def new_response_id(endpoint: Endpoint) -> str:
    """`chatcmpl-<hex>`, `cmpl-<hex>` or `<hex>`: the response id, X-Request-Id and rid."""
    return _ID_PREFIX[endpoint] + uuid.uuid4().hex


@dataclass(frozen=True)
class GenerationPlan:
    """One HTTP generation request as the bus sees it, plus how to answer it."""

    endpoint: Endpoint
    response_id: str
    model: str  # the served model name, echoed in the response
    submits: tuple[SubmitRequest, ...]
    n: int
    stream: bool
    include_usage: bool = False  # stream: a last chunk with the usage
    logprobs: bool = False  # put logprobs in the answer
    # `/v1/completions` with `echo`: each prompt's text, prepended to its choices.
    echo_texts: tuple[str, ...] = ()
    # `/generate` answers a list when the input was a batch or n > 1.
    batch: bool = False
    # chat: the functions the model may call, and how its answer is read back.
    tools: ToolPlan | None = None
    # chat: how the model writes its reasoning (the gateway's parser; None: none), counted
    # in usage, and whether the answer carries it apart from the content (the request's
    # `separate_reasoning`, default true).
    reasoning: ReasoningFormat | None = None
    separate_reasoning: bool = True
    # The body's `priority` (None: not given; the submits then carry 0), for the gateway
    # to weigh against what the caller may ask before `with_priority`.
    requested_priority: int | None = None

    @property
    def rids(self) -> tuple[str, ...]:
        return tuple(s.rid for s in self.submits)

    @property
    def num_choices(self) -> int:
        return len(self.submits) * self.n

    @property
    def reasoning_apart(self) -> ReasoningFormat | None:
        """The format the answer's reasoning is split from its content by: None without a
        parser, or when the request said `separate_reasoning: false`."""
        return self.reasoning if self.separate_reasoning else None

    def choice_index(self, prompt_index: int, choice: int) -> int:
        """The merged `index` of a choice in the answer."""
        return prompt_index * self.n + choice

    def client_error(self, error: ApiError) -> ApiError:
        """A service's error about a field this plan (or the tokenizer, for strict tools)
        made from another one, named as the client sent it: a grammar made of the
        client's `tools` is `tools`."""
        if self.tools is None or not self.submits:
            return error
        sampling = self.submits[0].sampling
        if error.param == "json_schema" and self.tools.schema is not None:
            error.param = "tools"
        elif error.param == "structural_tag" and sampling.structural_tag is None:
            error.param = "tools"  # the strict tools' tag, added by the tokenizer
        return error


# -- the three endpoints ----------------------------------------------------------------


def plan_chat(
    req: ChatCompletionRequest,
    *,
    response_id: str,
    gateway_id: str,
    served_model: str,
    arrival_time: float,
    reasoning_parser: str | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> GenerationPlan:
    """`reasoning_parser`: the gateway's (chat_format/reasoning.py); the answer's reasoning is
    then split from its content unless the request says `separate_reasoning: false`, and
    counted in usage either way."""
    check_model(req.model, served_model)
    check_messages(len(req.messages), limits)
    if req.tools:
        check_tools(req.tools, limits)
    tools = plan_tools(req)
    if tools is not None and tools.schema is not None:  # a required or named call
        check_grammar(tools.schema, "tools", limits)
    template_kwargs = _template_kwargs(req.chat_template_kwargs)
    if req.continue_final_message and req.messages and req.messages[-1].role != "assistant":
        raise ApiError.invalid(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    reasoning = None if reasoning_parser is None else REASONING_FORMATS[reasoning_parser]
    messages = chat_messages(req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError.invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens, max_param = _first_set(
        (req.max_completion_tokens, "max_completion_tokens"), (req.max_tokens, "max_tokens")
    )
    sampling = _openai_sampling(
        req,
        max_new_tokens=_output_tokens(max_tokens, CHAT_DEFAULT_MAX_TOKENS, max_param, limits),
        max_param=max_param,
        return_logprob=bool(req.logprobs),
        top_logprobs_num=req.top_logprobs or 0,
        response_format=req.response_format,
        limits=limits,
    )
    if tools is not None and tools.schema is not None:  # a required or named call
        sampling = msgspec.structs.replace(sampling, json_schema=tools.schema)
    submit = SubmitRequest(
        rid=response_id,
        gateway_id=gateway_id,
        sampling=sampling,
        messages=messages,
        stream=bool(req.stream),
        priority=req.priority or 0,
        arrival_time=arrival_time,
        model=served_model,
        tools=None if tools is None else tools.tools_json,
        chat_template_kwargs=template_kwargs,
        continue_final_message=bool(req.continue_final_message),
    )
    return GenerationPlan(
        endpoint="chat",
        response_id=response_id,
        model=served_model,
        submits=(submit,),
        n=sampling.n,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        logprobs=bool(req.logprobs),
        tools=tools,
        reasoning=reasoning,
        separate_reasoning=req.separate_reasoning is not False,
        requested_priority=req.priority,
    )


def plan_completion(
    req: CompletionRequest,
    *,
    response_id: str,
    gateway_id: str,
    served_model: str,
    arrival_time: float,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> GenerationPlan:
    check_model(req.model, served_model)
    if req.best_of not in (None, 1):
        raise ApiError.invalid("best_of is not supported: use n", "best_of")
    if req.suffix:
        raise ApiError.invalid("suffix (insertion) is not supported", "suffix")
    prompts = completion_prompts(req.prompt)
    check_prompts(len(prompts), "prompt", limits)
    echo_texts: tuple[str, ...] = ()
    if req.echo:
        if not all(isinstance(p, str) for p in prompts):
            raise ApiError.invalid(
                "echo is not supported for token-id prompts (the gateway has no tokenizer "
                "to turn them back into text)",
                "echo",
            )
        echo_texts = tuple(p for p in prompts if isinstance(p, str))
    sampling = _openai_sampling(
        req,
        max_new_tokens=_output_tokens(
            req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens", limits
        ),
        max_param="max_tokens",
        return_logprob=req.logprobs is not None,
        top_logprobs_num=req.logprobs or 0,
        response_format=req.response_format,
        limits=limits,
    )
    if echo_texts and req.logprobs is not None:  # OpenAI: the echoed prompt's logprobs too
        sampling = msgspec.structs.replace(sampling, logprob_start_len=0)
    submits = _prompt_submits(
        prompts,
        response_id,
        gateway_id,
        sampling,
        bool(req.stream),
        served_model,
        arrival_time,
        req.priority or 0,
    )
    return GenerationPlan(
        endpoint="completion",
        response_id=response_id,
        model=served_model,
        submits=submits,
        n=sampling.n,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        logprobs=req.logprobs is not None,
        echo_texts=echo_texts,
        requested_priority=req.priority,
    )


def plan_generate(
    req: GenerateRequest,
    *,
    response_id: str,
    gateway_id: str,
    served_model: str,
    arrival_time: float,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> GenerationPlan:
    if (req.text is None) == (req.input_ids is None):
        raise ApiError.invalid("give exactly one of text or input_ids", "text")
    prompts: list[PromptInput]
    batch: bool
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts = list(req.text) if isinstance(req.text, list) else [req.text]
        if not prompts:
            raise ApiError.invalid("text must not be an empty list", "text")
    else:
        assert req.input_ids is not None
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = id_prompts(req.input_ids, "input_ids")
    check_prompts(len(prompts), "text" if req.text is not None else "input_ids", limits)
    values = req.sampling_params.model_dump(exclude_none=True) if req.sampling_params else {}
    check_sampling(values, "sampling_params.", limits)
    values["stop"] = normalize_stop(values.get("stop"))
    values["max_new_tokens"] = _output_tokens(
        values.get("max_new_tokens"),
        GENERATE_DEFAULT_MAX_NEW_TOKENS,
        "sampling_params.max_new_tokens",
        limits,
    )
    _check_min_tokens(
        values.get("min_new_tokens"),
        values["max_new_tokens"],
        "sampling_params.min_new_tokens",
    )
    _check_one_grammar(values, "sampling_params.")
    if values.get("logit_bias") is not None:
        values["logit_bias"] = logit_bias(values["logit_bias"], "sampling_params.logit_bias")
    values["return_logprob"] = bool(req.return_logprob)
    values["top_logprobs_num"] = req.top_logprobs_num or 0
    if req.logprob_start_len is not None:
        values["logprob_start_len"] = req.logprob_start_len
    sampling = SamplingParams(**values)
    submits = _prompt_submits(
        prompts,
        response_id,
        gateway_id,
        sampling,
        bool(req.stream),
        served_model,
        arrival_time,
        req.priority or 0,
    )
    return GenerationPlan(
        endpoint="generate",
        response_id=response_id,
        model=served_model,
        submits=submits,
        n=sampling.n,
        stream=bool(req.stream),
        logprobs=bool(req.return_logprob),
        batch=batch or sampling.n > 1,
        requested_priority=req.priority,
    )


def with_priority(plan: GenerationPlan, priority: int) -> GenerationPlan:
    """The plan with every submit at `priority` (the gateway's decision, e.g. the body's
    `requested_priority` clamped to what the caller's API key may ask)."""
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}")
    if all(s.priority == priority for s in plan.submits):
        return plan  # the common case (no priorities anywhere): nothing to copy
    submits = tuple(msgspec.structs.replace(s, priority=priority) for s in plan.submits)
    return replace(plan, submits=submits)


# -- the pieces ---------------------------------------------------------------------------


# apply_chat_template's own arguments: a client's chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
     "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


def _template_kwargs(kwargs: dict[str, Any] | None) -> str | None:
    """`chat_template_kwargs` as the JSON text the tokenizer passes to the template."""
    if not kwargs:
        return None
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ApiError.invalid(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    return json.dumps(kwargs)


def logit_bias(bias: dict[str, float], param: str) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings, values in [-100, 100]) with int ids;
    whether the ids are in the vocabulary is the engine's to say."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ApiError.invalid(f"logit_bias keys are token ids, got {key!r}", param)
        if not -100 <= value <= 100:
            raise ApiError.invalid(
                f"logit_bias values must be in [-100, 100], got {value} for {key}", param
            )
        out[int(key)] = value
    return out or None


def check_model(requested: str | None, served: str) -> None:
    """A request names the served model or none at all; anything else is a 404."""
    if requested and requested != served:
        raise ApiError.model_not_found(requested)


def rid_for(response_id: str, prompt_index: int, num_prompts: int) -> str:
    """The bus rid of one prompt: the response id itself, or `<id>-<i>` for a list."""
    return response_id if num_prompts == 1 else f"{response_id}-{prompt_index}"


def _prompt_submits(
    prompts: Sequence[PromptInput],
    response_id: str,
    gateway_id: str,
    sampling: SamplingParams,
    stream: bool,
    model: str,
    arrival_time: float,
    priority: int,
) -> tuple[SubmitRequest, ...]:
    submits = []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        ids = None if isinstance(prompt, str) else pack_tokens(prompt)
        submits.append(
            SubmitRequest(
                rid=rid_for(response_id, i, len(prompts)),
                gateway_id=gateway_id,
                sampling=sampling,
                text=text,
                input_ids=ids,
                stream=stream,
                priority=priority,
                arrival_time=arrival_time,
                model=model,
            )
        )
    return tuple(submits)


def _openai_sampling(
    req: OpenAISamplingFields,
    *,
    max_new_tokens: int,
    max_param: str,
    return_logprob: bool,
    top_logprobs_num: int,
    response_format: ResponseFormat | None,
    limits: RequestLimits,
) -> SamplingParams:
    _check_min_tokens(req.min_tokens, max_new_tokens, "min_tokens", max_param)
    values: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "n": req.n,
        "seed": req.seed,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "return_logprob": return_logprob,
        "top_logprobs_num": top_logprobs_num,
        "regex": req.regex,
        "json_schema": req.json_schema,
        "ebnf": req.ebnf,
        "structural_tag": req.structural_tag,
        "logit_bias": req.logit_bias,
    }
    check_sampling(values, "", limits)
    values["stop"] = normalize_stop(req.stop)
    if req.logit_bias is not None:
        values["logit_bias"] = logit_bias(req.logit_bias, "logit_bias")
    grammar = response_format_grammar(response_format)
    if grammar is not None:
        assert response_format is not None
        check_grammar(grammar[1], RESPONSE_FORMAT_PARAM[response_format.type], limits)
        values["response_format"] = grammar[1]
    _check_one_grammar(values, "")
    if grammar is not None:
        values[grammar[0]] = values.pop("response_format")
    return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _check_one_grammar(values: dict[str, Any], prefix: str) -> None:
    names = [n for n in (*GRAMMAR_FIELDS, "response_format") if values.get(n) is not None]
    if len(names) > 1:
        raise ApiError.invalid(
            "at most one of regex, json_schema, ebnf, structural_tag, response_format may be "
            f"set, got {names}",
            prefix + names[-1],
        )


def _check_min_tokens(
    min_tokens: int | None, max_tokens: int, param: str, max_param: str | None = None
) -> None:
    if min_tokens is not None and min_tokens > max_tokens:
        bound = f"{max_param}={max_tokens}" if max_param else str(max_tokens)
        raise ApiError.invalid(f"{param} must be <= {bound} (got {min_tokens})", param)


def _output_tokens(value: int | None, default: int, param: str, limits: RequestLimits) -> int:
    """The client's length, checked against the bound, or the endpoint's default kept
    within it (a server configured below the default still answers)."""
    if value is None:
        return min(default, limits.max_output_tokens)
    check_output_tokens(value, param, limits)
    return value


def _first_set(*candidates: tuple[int | None, str]) -> tuple[int | None, str]:
    for value, name in candidates:
        if value is not None:
            return value, name
    return None, candidates[-1][1]


def _include_usage(req: OpenAISamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)
