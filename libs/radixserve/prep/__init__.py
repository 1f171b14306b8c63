"""The tokenizer service's library: a `SubmitRequest` -> a checked `TokenizedRequest`.

    prompter = load_prompt_tokenizer(model_dir, context_length=None)
    prompt = prompter.prepare(submit)              # ids, or PrepError (400)
    spec = grammar_spec(submit.sampling)           # None, or the grammar to compile
    ... grammar service: compile_request(...) -> key_from_reply(reply, spec)
    tokenized = tokenized_request(submit, prompt, grammar_key)

Every refusal is a `PrepError`; `err.to_request_error(rid)` is the wire form.
Importing this package loads transformers (the tokenizer); services import it lazily.
"""

from __future__ import annotations

from radixserve.prep.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    GRAMMAR_NOT_SUPPORTED,
    GRAMMAR_UNAVAILABLE,
    INVALID_REQUEST,
    PrepError,
)
from radixserve.prep.grammar import (
    GrammarSpec,
    compile_request,
    grammar_spec,
    key_from_reply,
    unavailable_error,
)
from radixserve.prep.prompt import (
    PromptIds,
    PromptTokenizer,
    load_prompt_tokenizer,
)
from radixserve.prep.request import request_address, tokenized_request

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "GRAMMAR_NOT_SUPPORTED",
    "GRAMMAR_UNAVAILABLE",
    "INVALID_REQUEST",
    "GrammarSpec",
    "PrepError",
    "PromptIds",
    "PromptTokenizer",
    "compile_request",
    "grammar_spec",
    "key_from_reply",
    "load_prompt_tokenizer",
    "request_address",
    "tokenized_request",
    "unavailable_error",
]
