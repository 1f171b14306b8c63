"""Structured outputs through the whole stack, driven with the `openai` client.

Real NATS and Redis, the six services as processes; a tiny random-weight Llama (only
the constraint can make its output valid) and, marked slow, the embedded SmolLM2.
References: `jsonschema` / `re.fullmatch` / Python's parser for validity; the
in-process engine for unconstrained outputs (which constrained neighbours in the
batch must not change).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve import Engine
from tests.helpers.structured_cases import (
    ARITHMETIC_EBNF,
    JSON_SCHEMAS,
    REGEXES,
    check_arithmetic,
    check_json,
    check_regex,
)
from tests.helpers.tiny_models import embedded_model_dir, make_tiny_llama
from tests.integration.stack_fixture import (
    BATCH_EXACT_DTYPE,
    CPU_WORKER_ARGS,
    RunningStack,
    running_stack,
)

pytestmark = pytest.mark.timeout(300)

CONTEXT = 1024


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "smollm2":
        return embedded_model_dir()
    return make_tiny_llama(tmp_path_factory.mktemp("structured_model"), seed=0)


@pytest.fixture(scope="module")
def stack(
    nats_url: str, redis_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    with running_stack(
        nats_url,
        redis_url,
        model_dir,
        tmp_path_factory.mktemp("structured_logs"),
        CPU_WORKER_ARGS,
        context_length=CONTEXT,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(
        model_path=str(model_dir), device="cpu", dtype=BATCH_EXACT_DTYPE, context_length=CONTEXT
    )


@pytest.fixture()
def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, stack: RunningStack, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kwargs,
    )


def test_response_format_schemas_regexes_and_grammar(
    client: openai.OpenAI, stack: RunningStack
) -> None:
    """All 20 schemas (chat, `response_format` json_schema, strict), the 8 regexes and
    the arithmetic EBNF (completions, SGLang's fields), 8 requests at a time."""

    def schema_case(schema: dict[str, Any]) -> None:
        reply = _chat(
            client,
            stack,
            "Answer with a JSON document.",
            max_tokens=256,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )
        assert reply.choices[0].finish_reason == "stop"
        check_json(reply.choices[0].message.content, schema)

    def regex_case(name: str) -> None:
        out = client.completions.create(
            model=stack.model,
            prompt=f"An example of {name}:",
            max_tokens=96,
            temperature=0,
            extra_body={"regex": REGEXES[name]},
        )
        check_regex(out.choices[0].text, REGEXES[name])

    def grammar_case() -> None:
        out = client.completions.create(
            model=stack.model,
            prompt="A sum:",
            max_tokens=64,
            temperature=0,
            extra_body={"ebnf": ARITHMETIC_EBNF},
        )
        check_arithmetic(out.choices[0].text)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(schema_case, schema) for schema in JSON_SCHEMAS]
        futures += [pool.submit(regex_case, name) for name in REGEXES]
        futures.append(pool.submit(grammar_case))
        for future in futures:
            future.result()
    # json_object: any JSON object (unbounded; this prompt's greedy path closes it).
    out = client.completions.create(
        model=stack.model,
        prompt="Answer in JSON:",
        max_tokens=128,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(out.choices[0].text), dict)
    # A structural tag (SGLang's response_format form): free text, then tagged JSON.
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = _chat(
        client,
        stack,
        "Call the tool.",
        max_tokens=48,
        response_format={
            "type": "structural_tag",
            "structures": [{"begin": "<call>", "schema": schema, "end": "</call>"}],
            "triggers": ["<call>"],
        },
    )
    for body in re.findall(r"<call>(.*?)</call>", reply.choices[0].message.content, flags=re.S):
        check_json(body, schema)


def test_invalid_grammars_are_400_with_the_field(
    client: openai.OpenAI, stack: RunningStack
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(
            client,
            stack,
            "hi",
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    assert (info.value.code, info.value.param) == ("invalid_grammar", "json_schema")
    assert "nonsense" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, stack, "hi", max_tokens=8, extra_body={"regex": "[a-"})
    assert (info.value.code, info.value.param) == ("invalid_grammar", "regex")


def test_n_streaming_stop_and_logprobs(client: openai.OpenAI, stack: RunningStack) -> None:
    schema = JSON_SCHEMAS[10]
    stream = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Points as JSON."}],
        n=2,
        temperature=1.0,
        seed=5,
        max_tokens=256,
        logprobs=True,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    texts = ["", ""]
    logprob_entries = [0, 0]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprob_entries[choice.index] += len(choice.logprobs.content)
    for text, entries in zip(texts, logprob_entries, strict=True):
        check_json(text, schema)
        assert entries > 0
    stopped = client.completions.create(
        model=stack.model,
        prompt="Code:",
        max_tokens=32,
        temperature=0,
        stop=["-"],
        extra_body={"regex": r"[a-z]{3}-[0-9]{3}"},
    )
    assert re.fullmatch("[a-z]{3}", stopped.choices[0].text)
    assert stopped.choices[0].finish_reason == "stop"


def test_constrained_and_unconstrained_requests_side_by_side(
    client: openai.OpenAI, stack: RunningStack, engine: Engine
) -> None:
    prompts = [f"Request number {i} says" for i in range(8)]
    reference = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 12})
    assert isinstance(reference, list)

    def free(prompt: str) -> str:
        out = client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=12, temperature=0
        )
        return str(out.choices[0].text)

    def constrained(i: int) -> str:
        schema = JSON_SCHEMAS[(5 * i) % len(JSON_SCHEMAS)]
        out = client.completions.create(
            model=stack.model,
            prompt=f"Document {i}:",
            max_tokens=256,
            temperature=0,
            extra_body={"json_schema": json.dumps(schema)},
        )
        check_json(out.choices[0].text, schema)
        return str(out.choices[0].text)

    with ThreadPoolExecutor(16) as pool:
        frees = [pool.submit(free, p) for p in prompts]
        cons = [pool.submit(constrained, i) for i in range(8)]
        assert [f.result() for f in frees] == [r["text"] for r in reference]
        for future in cons:
            future.result()
