"""A request's prompt as token ids, checked against the model's vocabulary and context.

    prompter = load_prompt_tokenizer(model_dir, context_length=None)  # the worker's default
    prompt = prompter.prompt_ids(submit)        # PrepError on an empty or invalid prompt
    prompter.check_fits(prompt, submit.sampling.max_new_tokens)   # PrepError (400)

The chat template and the tokenizer are the engine's (`model_files.tokenizer`), so a
prompt is tokenized here exactly as `Engine.chat` / `Engine.generate` would.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from radixserve.chat_format.tool_prompt import (
    keeps_special_markers,
    special_tokens,
    strict_tools_tag,
    template_inputs,
)
from radixserve.model_files.config import ModelConfig
from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer, tokenizer_id
from radixserve.prep.errors import CONTEXT_LENGTH_EXCEEDED, PrepError
from radixserve.prep.grammar import grammar_spec
from radixserve.protocol import SubmitRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptIds:
    """A prompt's token ids and the request field they came from (the error `param`)."""

    ids: list[int]
    param: str  # "messages" or "prompt"

    @property
    def source_words(self) -> str:
        """How the length error names the prompt: OpenAI says "in the messages" for chat."""
        return "the messages" if self.param == "messages" else "the prompt"


class PromptTokenizer:
    """The model's tokenizer plus the limits a prompt is checked against."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_len: int,
        tokenizer_id: str,
    ) -> None:
        if context_len <= 0:
            raise ValueError(f"context length must be > 0, got {context_len}")
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.tokenizer_id = tokenizer_id
        # len(): the base vocabulary plus added special tokens, every id the model can see.
        self.vocab_size = len(tokenizer)
        self._specials = special_tokens(tokenizer)

    def prepare(self, req: SubmitRequest) -> PromptIds:
        """The prompt's ids, checked to fit the context with `max_new_tokens` (CPU-bound:
        call it off the event loop)."""
        prompt = self.prompt_ids(req)
        self.check_fits(prompt, req.sampling.max_new_tokens)
        return prompt

    def prompt_ids(self, req: SubmitRequest) -> PromptIds:
        """messages -> chat template ids; text -> the tokenizer's encode; input_ids as given."""
        if req.messages is not None:
            prompt = PromptIds(self._render_messages(req), "messages")
        elif req.text is not None:
            # The tokenizer's own default special tokens, as Engine._normalize_prompts does.
            ids: list[int] = self.tokenizer.encode(req.text)
            prompt = PromptIds(ids, "prompt")
        else:
            prompt = PromptIds(req.input_ids_list or [], "prompt")
            self.check_vocab(prompt)
        if not prompt.ids:
            raise PrepError("the prompt is empty (no tokens)", param=prompt.param)
        return prompt

    def with_strict_tools(self, req: SubmitRequest) -> SubmitRequest:
        """`req` with a structural tag that holds its strict tools' calls to their
        schemas (`tool_prompt.strict_tools_tag`) when the model may call them freely (no
        grammar of its own: `tool_choice` auto); `req` as it is otherwise."""
        sampling = req.sampling
        if not req.tools or grammar_spec(sampling) is not None:
            return req
        try:
            tag = strict_tools_tag(getattr(self.tokenizer, "chat_template", None), req.tools)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise PrepError(f"tools are not a list of functions: {exc}", param="tools") from exc
        if tag is None:
            return req
        return msgspec.structs.replace(
            req, sampling=msgspec.structs.replace(sampling, structural_tag=tag)
        )

    def with_call_markers(self, req: SubmitRequest) -> SubmitRequest:
        """`req` with special tokens kept in its answer's text when the model may call its
        tools freely (no grammar of its own) in a format whose marker is a special token
        of this tokenizer, as Mistral's make `[TOOL_CALLS]` (and `[ARGS]`): without the
        markers, `chat_format.tool_calls` cannot tell calls from the content written before them.
        The text is as the model wrote it (no spaces put around the special tokens), and
        the stop token that ends the answer still leaves it (detok/stop.py). `req` as it
        is otherwise."""
        sampling = req.sampling
        if not req.tools or not sampling.skip_special_tokens or grammar_spec(sampling) is not None:
            return req
        template = getattr(self.tokenizer, "chat_template", None)
        if not keeps_special_markers(template, self._specials):
            return req
        kept = msgspec.structs.replace(
            sampling, skip_special_tokens=False, spaces_between_special_tokens=False
        )
        return msgspec.structs.replace(req, sampling=kept)

    def check_vocab(self, prompt: PromptIds) -> None:
        """Every id must name a token of this model (ids from the client are not trusted)."""
        bad = [i for i in prompt.ids if i < 0 or i >= self.vocab_size]
        if bad:
            which = f"token id {bad[0]} is" if len(bad) == 1 else f"{len(bad)} token ids are"
            raise PrepError(
                f"{which} outside the vocabulary [0, {self.vocab_size}) (first: {bad[0]})",
                param=prompt.param,
            )

    def check_fits(self, prompt: PromptIds, max_new_tokens: int) -> None:
        """prompt + completion must fit the context, with OpenAI's message for when not."""
        completion = max(max_new_tokens, 0)
        requested = len(prompt.ids) + completion
        if requested > self.context_len:
            raise PrepError(
                f"This model's maximum context length is {self.context_len} tokens. "
                f"However, you requested {requested} tokens ({len(prompt.ids)} in "
                f"{prompt.source_words}, {completion} in the completion). Please reduce "
                f"the length of {prompt.source_words} or completion.",
                code=CONTEXT_LENGTH_EXCEEDED,
                param=prompt.param,
            )

    def _render_messages(self, req: SubmitRequest) -> list[int]:
        assert req.messages is not None
        if not req.messages:
            raise PrepError("messages must hold at least one message", param="messages")
        try:
            messages, tools = template_inputs(
                getattr(self.tokenizer, "chat_template", None), req.messages, req.tools
            )
            kwargs = json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else None
            if kwargs is not None and not isinstance(kwargs, dict):
                raise ValueError("chat_template_kwargs must be a JSON object")
            return apply_chat_template(
                self.tokenizer, messages, tools, kwargs, req.continue_final_message
            )
        except Exception as exc:
            # A template may reject a conversation on purpose (`raise_exception` in
            # Jinja: roles that do not alternate, ...): that is the client's 400.
            log.info("chat template failed: %r", exc, extra={"rid": req.rid})
            raise PrepError(
                f"cannot apply the model's chat template: {exc}", param="messages"
            ) from exc


def load_prompt_tokenizer(model_dir: str | Path, context_length: int | None) -> PromptTokenizer:
    """The tokenizer of a Hugging Face folder; `context_length` None -> the model's
    `max_position_embeddings` (the worker's default, so both sides agree)."""
    folder = Path(model_dir)
    if context_length is None:
        context_length = ModelConfig.from_pretrained(folder).max_position_embeddings
    return PromptTokenizer(load_tokenizer(folder), context_length, tokenizer_id(folder))
