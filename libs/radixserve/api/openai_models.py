"""Request bodies of `/v1/chat/completions` and `/v1/completions` (pydantic, strict).

Only types and ranges are checked here; what depends on several fields (a
`top_logprobs` without `logprobs`, `echo` of token ids, two grammars at once) is
`mapping`'s, which names the offending `param`. Optional fields are `None` when the
client left them out or sent null: `mapping` fills the defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from radixserve.api.fields import (
    Body,
    CompletionLogprobs,
    MaxTokens,
    NumChoices,
    Penalty,
    Priority,
    Seed,
    SGLangSamplingFields,
    Stop,
    Temperature,
    TokenId,
    TopLogprobsNum,
    TopP,
)


class StreamOptions(Body):
    include_usage: bool | None = None


class ContentPart(Body):
    """One part of a message's content; only `text` parts are served (others get a 400)."""

    type: str
    text: str | None = None


class FunctionCallIn(Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(Body):
    """A call an earlier assistant message made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(Body):
    """A chat message as the client sends it: text content, an assistant's `tool_calls`,
    a `tool` message's `tool_call_id`. The roles are OpenAI's: any other is a 400, not a
    message the chat template renders as it happens to."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(Body):
    """One tool the model may call (OpenAI's only kind: a function)."""

    type: Literal["function"]
    function: FunctionDef


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    """`tool_choice` naming the function the model must call."""

    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Body):
    name: str | None = None
    # `schema` would shadow a BaseModel attribute: the JSON key is an alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag", SGLang's form: free text until a trigger, then a tagged
    # JSON object per structure ({"begin", "schema", "end"}).
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class OpenAISamplingFields(SGLangSamplingFields):
    """What chat and completions share: the model, sampling and streaming fields."""

    model: str | None = None
    n: NumChoices | None = None
    stop: Stop | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> [-100, 100]
    priority: Priority | None = None  # SGLang's: higher is admitted first (default 0)


class ChatCompletionRequest(OpenAISamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobsNum | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of tools: refused with a pointer to the current ones
    # (ignored, an agent would wait for a call that never comes).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # SGLang's and vLLM's extensions: more variables for the chat template (e.g. Qwen3's
    # enable_thinking), and whether to answer the reasoning apart (with a reasoning
    # parser set on the gateway; default true).
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool | None = None
    # vLLM's: the answer continues the last (assistant) message, e.g. a prefilled "{".
    continue_final_message: bool | None = None


# Token-id prompts are listed before string ones so `[1, 2]` is read as ids: pydantic's
# smart union takes the first exact match.
Prompt = str | list[TokenId] | list[list[TokenId]] | list[str]


class CompletionRequest(OpenAISamplingFields):
    prompt: Prompt
    echo: bool | None = None
    logprobs: CompletionLogprobs | None = None
    response_format: ResponseFormat | None = None
    # Not served: refused by `mapping` (ignored, they would change the answer unseen).
    best_of: int | None = None
    suffix: str | None = None
