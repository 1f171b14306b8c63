"""radixserve.prep with the real SmolLM2 tokenizer: prompts become the engine's ids, and
every refusal carries the code, param and message the gateway answers with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer, tokenizer_id
from radixserve.prep import (
    CONTEXT_LENGTH_EXCEEDED,
    GRAMMAR_NOT_SUPPORTED,
    GRAMMAR_UNAVAILABLE,
    PrepError,
    PromptIds,
    PromptTokenizer,
    compile_request,
    grammar_spec,
    key_from_reply,
    load_prompt_tokenizer,
    request_address,
    tokenized_request,
    unavailable_error,
)
from radixserve.protocol import (
    ChatMessage,
    GrammarCompileReply,
    SamplingParams,
    SubmitRequest,
    grammar_key,
    pack_tokens,
)
from tests.helpers.tiny_models import embedded_model_dir

CONTEXT = 64
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes, héhé 🙂."},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(embedded_model_dir())


@pytest.fixture(scope="module")
def prompter(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(load_tokenizer(model_dir), CONTEXT, tokenizer_id(model_dir))


def _submit(**fields: Any) -> SubmitRequest:
    sampling = fields.pop("sampling", SamplingParams(max_new_tokens=8))
    return SubmitRequest(rid="r-1", gateway_id="gw-1", sampling=sampling, **fields)


def _chat(messages: list[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _refusal(prompter: PromptTokenizer, req: SubmitRequest) -> PrepError:
    with pytest.raises(PrepError) as info:
        prompter.prepare(req)
    return info.value


# -- prompts -> ids ------------------------------------------------------------------


def test_messages_render_with_the_engines_chat_template(prompter: PromptTokenizer) -> None:
    prompt = prompter.prepare(_submit(messages=_chat(MESSAGES)))
    assert prompt.ids == apply_chat_template(prompter.tokenizer, MESSAGES)
    assert prompt.param == "messages"
    # The template's own markers, so the comparison is not between two empty lists.
    assert "<|im_start|>assistant" in prompter.tokenizer.decode(prompt.ids)


def test_text_is_encoded_with_the_tokenizers_default_special_tokens(
    prompter: PromptTokenizer,
) -> None:
    text = "The capital of France is"
    prompt = prompter.prepare(_submit(text=text))
    assert prompt.ids == prompter.tokenizer.encode(text)
    assert prompter.tokenizer.decode(prompt.ids) == text
    assert prompt.param == "prompt"


def test_input_ids_pass_through(prompter: PromptTokenizer) -> None:
    ids = [0, 1, 2, prompter.vocab_size - 1]
    prompt = prompter.prepare(_submit(input_ids=pack_tokens(ids)))
    assert prompt == PromptIds(ids, "prompt")


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_input_ids_outside_the_vocabulary_are_refused(
    prompter: PromptTokenizer, bad_id: int | str
) -> None:
    assert prompter.vocab_size == len(prompter.tokenizer) == 49152
    token = prompter.vocab_size if bad_id == "vocab" else int(bad_id)
    err = _refusal(prompter, _submit(input_ids=pack_tokens([5, token, 7])))
    assert (err.http_status, err.code, err.param) == (400, "invalid_request_error", "prompt")
    assert f"token id {token} is outside the vocabulary [0, 49152)" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": ""}, "prompt"),
        ({"input_ids": b""}, "prompt"),
        ({"messages": []}, "messages"),
    ],
)
def test_an_empty_prompt_is_a_400(
    prompter: PromptTokenizer, fields: dict[str, Any], param: str
) -> None:
    err = _refusal(prompter, _submit(**fields))
    assert (err.http_status, err.param) == (400, param)


def test_a_template_that_refuses_the_conversation_is_a_400(prompter: PromptTokenizer) -> None:
    tokenizer = prompter.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        err = _refusal(prompter, _submit(messages=_chat(MESSAGES)))
    finally:
        tokenizer.chat_template = original
    assert (err.http_status, err.param) == (400, "messages")
    assert "roles must alternate" in err.message


# -- context length -------------------------------------------------------------------


def test_prompt_plus_completion_may_fill_the_context_exactly(prompter: PromptTokenizer) -> None:
    ids = [42] * 40
    fits = _submit(input_ids=pack_tokens(ids), sampling=SamplingParams(max_new_tokens=24))
    assert prompter.prepare(fits).ids == ids
    over = _submit(input_ids=pack_tokens(ids), sampling=SamplingParams(max_new_tokens=25))
    err = _refusal(prompter, over)
    assert (err.http_status, err.code, err.param) == (400, CONTEXT_LENGTH_EXCEEDED, "prompt")
    assert err.message.startswith(
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(40 in the prompt, 25 in the completion)."
    )


def test_chat_over_the_context_names_the_messages(prompter: PromptTokenizer) -> None:
    n_prompt = len(apply_chat_template(prompter.tokenizer, MESSAGES))
    req = _submit(messages=_chat(MESSAGES), sampling=SamplingParams(max_new_tokens=CONTEXT))
    err = _refusal(prompter, req)
    assert (err.code, err.param) == (CONTEXT_LENGTH_EXCEEDED, "messages")
    assert (
        f"you requested {n_prompt + CONTEXT} tokens ({n_prompt} in the messages, "
        f"{CONTEXT} in the completion)" in err.message
    )
    wire = err.to_request_error("r-1")
    assert (wire.rid, wire.code, wire.param, wire.http_status, wire.service) == (
        "r-1",
        CONTEXT_LENGTH_EXCEEDED,
        "messages",
        400,
        "tokenizer",
    )


def test_default_context_length_is_the_models(model_dir: Path) -> None:
    from radixserve.model_files.config import ModelConfig

    prompter = load_prompt_tokenizer(model_dir, None)
    assert prompter.context_len == ModelConfig.from_pretrained(model_dir).max_position_embeddings
    assert prompter.context_len == 8192
    assert load_prompt_tokenizer(model_dir, 100).context_len == 100


# -- grammar ----------------------------------------------------------------------------


def test_no_grammar_fields_means_no_grammar() -> None:
    assert grammar_spec(SamplingParams()) is None


def test_grammar_request_names_the_field_and_the_tokenizer(prompter: PromptTokenizer) -> None:
    spec = grammar_spec(SamplingParams(json_schema='{"type": "object"}'))
    assert spec is not None and (spec.kind, spec.param) == ("json_schema", "json_schema")
    request = compile_request("r-9", spec, prompter.tokenizer_id)
    assert (request.rid, request.kind, request.source, request.tokenizer_id) == (
        "r-9",
        "json_schema",
        '{"type": "object"}',
        prompter.tokenizer_id,
    )
    key = grammar_key("json_schema", '{"type": "object"}', prompter.tokenizer_id)
    assert key_from_reply(GrammarCompileReply(rid="r-9", key=key, ok=True), spec) == key


def test_two_grammars_at_once_are_a_400() -> None:
    with pytest.raises(PrepError) as info:
        grammar_spec(SamplingParams(regex="a+", ebnf='root ::= "a"'))
    assert (info.value.http_status, info.value.param) == (400, "ebnf")


def test_a_refused_grammar_is_a_400_with_the_services_reason() -> None:
    spec = grammar_spec(SamplingParams(regex="[0-9]+"))
    assert spec is not None
    reply = GrammarCompileReply(rid="r", key="", ok=False, error="not supported yet")
    with pytest.raises(PrepError) as info:
        key_from_reply(reply, spec)
    err = info.value
    assert (err.http_status, err.code, err.param, err.message) == (
        400,
        GRAMMAR_NOT_SUPPORTED,
        "regex",
        "not supported yet",
    )


def test_a_silent_grammar_service_is_a_503_to_retry() -> None:
    spec = grammar_spec(SamplingParams(regex="x"))
    assert spec is not None
    err = unavailable_error(spec, "no reply within 5s").to_request_error("r-2")
    assert (err.http_status, err.code, err.param) == (503, GRAMMAR_UNAVAILABLE, "regex")
    assert err.retry_after_s is not None and err.retry_after_s > 0
    assert "no reply within 5s" in err.message


# -- the outgoing request and ids ---------------------------------------------------------


def test_tokenized_request_keeps_the_submit_fields(prompter: PromptTokenizer) -> None:
    sampling = SamplingParams(max_new_tokens=5, n=2, stop=["\n"])
    req = SubmitRequest(
        rid="r-5",
        gateway_id="gw-2",
        sampling=sampling,
        text="hello there",
        stream=True,
        priority=3,
        arrival_time=12.5,
        model="m",
    )
    prompt = prompter.prepare(req)
    out = tokenized_request(req, prompt, "regex:abc")
    assert out.input_ids_list == prompter.tokenizer.encode("hello there")
    assert (out.rid, out.gateway_id, out.sampling, out.grammar_key) == (
        "r-5",
        "gw-2",
        sampling,
        "regex:abc",
    )
    assert (out.stream, out.priority, out.arrival_time, out.model) == (True, 3, 12.5, "m")


def test_request_address_reads_a_body_that_fails_validation() -> None:
    body = msgspec.msgpack.encode(
        {"rid": "r-7", "gateway_id": "gw-3", "text": "a", "input_ids": b""}
    )
    assert request_address(body) == ("r-7", "gw-3")
    assert request_address(b"\x00garbage") is None
    assert request_address(msgspec.msgpack.encode({"rid": "r", "gateway_id": "a.b"})) is None


def test_tokenizer_id_follows_the_tokenizer_files(model_dir: Path, tmp_path: Path) -> None:
    data = (model_dir / "tokenizer.json").read_bytes()
    copy, same = tmp_path / "copy", tmp_path / "same"
    for folder in (copy, same):  # the same files anywhere (another host): the same id
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes(data)
    assert tokenizer_id(copy) == tokenizer_id(same)
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "tokenizer.json").write_bytes(data + b" ")
    assert tokenizer_id(copy) != tokenizer_id(changed)
    assert tokenizer_id(copy).startswith("tok-")
