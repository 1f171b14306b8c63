"""Structured outputs in the engine: every grammar kind, with a random-weight model that
only the constraint keeps valid, and with n > 1, streaming, stop strings, logprobs,
jump-forward, the radix cache and mixed constrained / unconstrained batches.

References: `jsonschema` / `re.fullmatch` / Python's parser for validity; the
unconstrained engine for unconstrained outputs; Hugging Face's forward for logprobs.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.api.response_format import JSON_OBJECT_SCHEMA
from tests.helpers.structured_cases import (
    ARITHMETIC_EBNF,
    JSON_SCHEMAS,
    LONG_KEYS_SCHEMA,
    REGEXES,
    check_arithmetic,
    check_json,
    check_regex,
)
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", debug_check_invariants=True
    )


Case = tuple[dict[str, Any], Callable[[str], object]]


def _cases() -> list[Case]:
    """(sampling params, validity check) for every schema, regex and the EBNF grammar."""
    cases: list[Case] = []
    for schema in JSON_SCHEMAS:
        cases.append(
            (
                {"json_schema": json.dumps(schema), "max_new_tokens": 256},
                lambda text, s=schema: check_json(text, s),
            )
        )
    for pattern in REGEXES.values():
        cases.append(
            ({"regex": pattern, "max_new_tokens": 96}, lambda text, p=pattern: check_regex(text, p))
        )
    cases.append(({"ebnf": ARITHMETIC_EBNF, "max_new_tokens": 64}, check_arithmetic))
    return cases


@contextmanager
def jump_forward(engine: Engine, on: bool) -> Iterator[None]:
    before = engine.grammars.jump_forward
    engine.grammars.jump_forward = on
    try:
        yield
    finally:
        engine.grammars.jump_forward = before


@contextmanager
def counting_forwards(engine: Engine) -> Iterator[list[int]]:
    """Counts the model's forward passes (one per scheduler step that computes)."""
    count = [0]
    forward = engine.runner.forward

    def counted(batch: Any) -> torch.Tensor:
        count[0] += 1
        return forward(batch)

    engine.runner.forward = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        del engine.runner.forward  # back to the class's method


def _generate(
    engine: Engine, prompts: list[str] | list[list[int]], params: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    greedy = [{"temperature": 0.0, **p} for p in params]
    if prompts and isinstance(prompts[0], str):
        out = engine.generate(prompt=prompts, sampling_params=greedy)  # type: ignore[arg-type]
    else:
        out = engine.generate(input_ids=prompts, sampling_params=greedy)  # type: ignore[arg-type]
    assert isinstance(out, list)
    return out


@pytest.mark.slow
def test_every_schema_regex_and_the_arithmetic_grammar_give_valid_output(engine: Engine) -> None:
    cases = _cases()
    outs = _generate(engine, ["Answer:"] * len(cases), [params for params, _ in cases])
    for (params, check), out in zip(cases, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (params, out["text"])
        check(out["text"])
    assert engine.num_tracked() == 0


@pytest.mark.slow
def test_json_object_and_structural_tag(engine: Engine) -> None:
    # `response_format: json_object` is any JSON object (unbounded: this prompt's greedy
    # path closes it; the SmolLM2 stack test gives a real one).
    out = engine.generate(
        prompt="Answer in JSON:",
        sampling_params={"temperature": 0, "max_new_tokens": 64, "json_schema": JSON_OBJECT_SCHEMA},
    )
    assert isinstance(out, dict) and isinstance(json.loads(out["text"]), dict)
    # A structural tag: free text until the trigger, then JSON between the tags.
    tag = {
        "structures": [
            {
                "begin": "<call>",
                "schema": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"],
                },
                "end": "</call>",
            }
        ],
        "triggers": ["<call>"],
    }
    out = engine.generate(
        prompt="Call the tool: <call>",
        sampling_params={"temperature": 0, "max_new_tokens": 48, "structural_tag": json.dumps(tag)},
    )
    assert isinstance(out, dict)
    for body in re.findall(r"<call>(.*?)</call>", out["text"], flags=re.S):
        assert json.loads(body)["n"] in range(10)


def test_invalid_grammars_name_their_field(engine: Engine) -> None:
    for field, source in (
        ("json_schema", '{"type": "nonsense"}'),
        ("json_schema", "{not json"),
        ("regex", "[a-"),
        ("ebnf", "root ::= undefined_rule"),
    ):
        with pytest.raises(ValueError, match=f"'{field}' is not a valid grammar"):
            engine.generate(input_ids=[5, 6], sampling_params={field: source})
    assert engine.scheduler.usage().in_flight_tokens == 0


def test_n_choices_each_have_their_own_matcher(engine: Engine) -> None:
    schema = JSON_SCHEMAS[18]  # the deep document
    outs = engine.generate(
        prompt="Order:",
        sampling_params={
            "json_schema": json.dumps(schema),
            "n": 4,
            "temperature": 1.0,
            "seed": 3,
            "max_new_tokens": 256,
        },
    )
    assert isinstance(outs, list) and len(outs) == 4
    for out in outs:
        check_json(out["text"], schema)
    assert len({o["text"] for o in outs}) > 1


def test_stream_deltas_add_up_to_the_blocking_result(engine: Engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 256, "json_schema": json.dumps(JSON_SCHEMAS[19])}
    whole = engine.generate(prompt="Shapes:", sampling_params=params)
    assert isinstance(whole, dict)

    async def collect() -> list[dict[str, Any]]:
        return [d async for d in engine.generate_stream(prompt="Shapes:", sampling_params=params)]

    deltas = asyncio.run(collect())
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert [t for d in deltas for t in d["output_ids"]] == whole["output_ids"]
    check_json(whole["text"], JSON_SCHEMAS[19])


def test_stop_strings_ignore_eos_and_min_tokens_with_a_grammar(engine: Engine) -> None:
    stopped, no_eos, too_short = _generate(
        engine,
        ["Code:", "Greet:", "Greet:"],
        [
            {"regex": r"[a-z]{3}-[0-9]{3}", "stop": ["-"], "max_new_tokens": 32},
            {"regex": "Hello, world!", "ignore_eos": True, "max_new_tokens": 50},
            # The grammar is complete long before min_new_tokens: it ends the request.
            {"regex": "Hello, world!", "min_new_tokens": 40, "max_new_tokens": 50},
        ],
    )
    assert re.fullmatch("[a-z]{3}", stopped["text"]), stopped["text"]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "-"}
    for out in (no_eos, too_short):
        assert out["text"] == "Hello, world!"
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.slow
def test_logprobs_are_the_models_own_distribution(engine: Engine, tiny_llama_dir: Path) -> None:
    """A constrained token's logprob is log_softmax of the raw logits (as unconstrained),
    checked against Hugging Face's forward over the same sequence."""
    from transformers import AutoModelForCausalLM

    prompt = make_prompts(engine.runner.vocab_size, [12], seed=4)[0]
    out = engine.generate(
        input_ids=prompt,
        sampling_params={
            "temperature": 0,
            "max_new_tokens": 64,
            "json_schema": json.dumps(JSON_SCHEMAS[3]),
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    assert isinstance(out, dict)
    check_json(out["text"], JSON_SCHEMAS[3])
    ours = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in ours] == out["output_ids"]  # one entry per token: no jump-forward
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    expected = reference.gather(1, torch.tensor(out["output_ids"]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([lp for lp, _ in ours]), expected, atol=1e-3)
    top = out["meta_info"]["output_top_logprobs"]
    assert [t for t, _ in top[0]] == reference[0].topk(3).indices.tolist()


@pytest.mark.slow
def test_no_matcher_state_crosses_requests_that_share_a_prefix(engine: Engine) -> None:
    prompt = make_prompts(engine.runner.vocab_size, [40], seed=9)[0]
    digits, letters = _generate(
        engine,
        [prompt, prompt],
        [{"regex": "[0-9]{6}", "max_new_tokens": 16}, {"regex": "[a-z]{6}", "max_new_tokens": 16}],
    )
    check_regex(digits["text"], "[0-9]{6}")
    check_regex(letters["text"], "[a-z]{6}")
    # The whole first sequence is cached now; a request that continues it starts its own
    # grammar from the beginning, not where the first request's matcher stopped.
    (upper,) = _generate(
        engine, [prompt + digits["output_ids"]], [{"regex": "[A-Z]{4}", "max_new_tokens": 16}]
    )
    assert upper["meta_info"]["cached_tokens"] >= len(prompt)
    check_regex(upper["text"], "[A-Z]{4}")
    # And an unconstrained request on the same cached prefix decodes as if alone.
    (free,) = _generate(engine, [prompt], [{"max_new_tokens": 8}])
    engine.flush_cache()
    (alone,) = _generate(engine, [prompt], [{"max_new_tokens": 8}])
    assert free["output_ids"] == alone["output_ids"]


@pytest.mark.slow
def test_jump_forward_saves_forward_passes_and_keeps_the_output_valid(engine: Engine) -> None:
    params = [{"json_schema": json.dumps(LONG_KEYS_SCHEMA), "max_new_tokens": 256}] * 2
    prompts = ["Customer record:", "Another customer:"]
    passes = {}
    for on in (False, True):
        engine.flush_cache()
        with jump_forward(engine, on), counting_forwards(engine) as count:
            outs = _generate(engine, prompts, params)
        passes[on] = count[0]
        for out in outs:
            check_json(out["text"], LONG_KEYS_SCHEMA)
    assert passes[True] <= 0.7 * passes[False], passes


@pytest.mark.slow
def test_64_constrained_and_64_unconstrained_requests_share_batches(engine: Engine) -> None:
    cases = _cases()
    vocab = engine.runner.vocab_size
    constrained = [cases[i % len(cases)] for i in range(64)]
    free_prompts = make_prompts(vocab, [8 + i % 24 for i in range(64)], seed=11)
    free_params = [{"max_new_tokens": 12 + i % 8} for i in range(64)]
    con_prompts = make_prompts(vocab, [6 + i % 10 for i in range(64)], seed=12)
    prompts = [p for pair in zip(con_prompts, free_prompts, strict=True) for p in pair]
    params = [
        p for pair in zip([c[0] for c in constrained], free_params, strict=True) for p in pair
    ]
    with jump_forward(engine, False):  # the mask alone (jump-forward has its own test)
        mixed = _generate(engine, prompts, params)
    for (_, check), out in zip(constrained, mixed[0::2], strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        check(out["text"])
    engine.flush_cache()
    alone = _generate(engine, free_prompts, free_params)
    assert [o["output_ids"] for o in mixed[1::2]] == [o["output_ids"] for o in alone]
    assert engine.num_tracked() == 0


def test_penalized_state_is_rebuilt_after_jump_forward(engine: Engine) -> None:
    """Jump-forward appends forced tokens on the host and re-prefills: the request's
    penalty state on the device is dropped and built again from its token lists (the
    engine checks it against a rebuild after every step: debug_check_invariants)."""
    state = engine.scheduler.penalty_state
    builds: list[int] = []
    add = state._add

    def counted(new: list[Any]) -> None:
        builds.append(len(new))
        add(new)

    state._add = counted  # type: ignore[method-assign]
    params = {
        "json_schema": json.dumps(LONG_KEYS_SCHEMA),
        "max_new_tokens": 256,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
    }
    try:
        engine.flush_cache()
        with jump_forward(engine, True):
            (out,) = _generate(engine, ["Customer record:"], [params])
    finally:
        del state._add
    check_json(out["text"], LONG_KEYS_SCHEMA)
    assert sum(builds) > 1  # built when first sampled, then again after each jump-forward
    assert len(state) == 0 and state.capacity == 0
