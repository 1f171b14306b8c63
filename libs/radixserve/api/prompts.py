"""The prompt fields of request bodies as the bus carries them: chat messages flattened
to text turns, `/v1/completions`' four prompt shapes and `/generate`'s token-id lists as
one entry per prompt, stop strings as a list. Each malformed value is an `ApiError`
naming its `param`."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.api.errors import ApiError
from radixserve.api.openai_models import ChatMessageIn
from radixserve.protocol import ChatMessage, ChatToolCall

PromptInput = str | list[int]


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    """A bare string or a list -> a list; empty strings (which would match at once) dropped."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in items if s]


def chat_messages(messages: Sequence[ChatMessageIn]) -> list[ChatMessage]:
    """Flatten content parts to text; anything but text parts is a 400."""
    if not messages:
        raise ApiError.invalid("messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            # Only an assistant's turn may go without text (its tool calls, or an empty
            # earlier answer); any other would reach the model as an empty turn.
            if message.role != "assistant":
                raise ApiError.invalid(
                    f"a {message.role} message needs its content", f"messages[{i}].content"
                )
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts: list[str] = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ApiError.invalid(
                        f"only text content parts are supported, got {part.type!r}",
                        f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise ApiError.invalid(
                        "a text content part needs its text", f"messages[{i}].content[{j}].text"
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        calls = [
            ChatToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or ()
        ]
        out.append(
            ChatMessage(
                role=message.role,
                content=text,
                name=message.name,
                tool_calls=calls or None,
                tool_call_id=message.tool_call_id,
            )
        )
    return out


def completion_prompts(prompt: str | list[int] | list[list[int]] | list[str]) -> list[PromptInput]:
    """`prompt` in its four OpenAI shapes -> one entry per prompt (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError.invalid("prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return [p for p in prompt if isinstance(p, str)]
    return id_prompts(prompt, "prompt")


def id_prompts(ids: list[int] | list[list[int]], param: str) -> list[PromptInput]:
    if not ids:
        raise ApiError.invalid(f"{param} must not be empty", param)
    if isinstance(ids[0], int):
        return [[i for i in ids if isinstance(i, int)]]
    prompts: list[PromptInput] = []
    for k, item in enumerate(ids):
        if not isinstance(item, list) or not item:
            raise ApiError.invalid(f"{param}[{k}] must be a non-empty list of token ids", param)
        prompts.append(item)
    return prompts
