"""The frontend language against an in-process engine: every generation of a program
equals what the engine itself generates for the prompt the program built (plain text,
chat turns rendered by the tokenizer's template, a select constrained to its choices,
forks, a batch), and programs written wrongly get clear errors.

A tiny random-weight Llama with the embedded model's tokenizer (and chat template).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import radixserve.lang as rl
from radixserve import Engine
from tests.unit.engine_helpers import hf_log_softmax

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(model_path=str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def backend(engine: Engine) -> rl.EngineBackend:
    return rl.EngineBackend(engine)


def _greedy(engine: Engine, prompt: str, max_new_tokens: int, **extra: Any) -> str:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}
    out = engine.generate(prompt=prompt, sampling_params=params)
    assert isinstance(out, dict)
    return str(out["text"])


@rl.function
def answer(s: rl.ProgramState, question: str) -> None:
    s += "Question: " + question + "\nAnswer:"
    s += rl.gen("answer", max_tokens=8, temperature=0)
    s += "\nDone."


def test_a_text_program_generates_what_the_engine_does(
    engine: Engine, backend: rl.EngineBackend
) -> None:
    state = answer.run("what is two plus two?", backend=backend)
    prompt = "Question: what is two plus two?\nAnswer:"
    expected = _greedy(engine, prompt, 8)
    assert expected  # a random model still says something
    assert state["answer"] == expected
    assert state.text() == prompt + expected + "\nDone."
    assert not state.is_chat


def test_chat_turns_render_through_the_chat_template(
    engine: Engine, backend: rl.EngineBackend
) -> None:
    @rl.function
    def chat(s: rl.ProgramState) -> None:
        s += rl.system("Be brief.")
        s += rl.user("Name a colour.")
        s += rl.assistant(rl.gen("first", max_tokens=6, temperature=0))
        s += rl.user("Another?")
        s += rl.assistant("Sure: " + rl.gen("second", max_tokens=6, temperature=0))

    state = chat.run(backend=backend)
    template = engine.tokenizer.apply_chat_template
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    first = _greedy(engine, template(turns, tokenize=False, add_generation_prompt=True), 6)
    assert state["first"] == first
    turns += [{"role": "assistant", "content": first}, {"role": "user", "content": "Another?"}]
    prompt = template(turns, tokenize=False, add_generation_prompt=True) + "Sure: "
    second = _greedy(engine, prompt, 6)
    assert state["second"] == second
    turns.append({"role": "assistant", "content": "Sure: " + second})
    assert state.messages() == turns
    assert state.text() == template(turns, tokenize=False)


@pytest.mark.parametrize(
    "choices", [["red", "green", "blue sky"], ["a.b", "(x)", "c|d", "[e]+"]], ids=["plain", "regex"]
)
def test_greedy_select_picks_a_choice_as_the_constrained_engine_does(
    engine: Engine, backend: rl.EngineBackend, choices: list[str]
) -> None:
    @rl.function
    def pick(s: rl.ProgramState) -> None:
        s += "Pick one: "
        s += rl.select("choice", choices, method="greedy")

    state = pick.run(backend=backend)
    assert state["choice"] in choices
    pattern = "(" + "|".join(re.escape(c) for c in choices) + ")"
    assert state["choice"] == _greedy(engine, "Pick one: ", 256, regex=pattern)
    assert state.text() == "Pick one: " + state["choice"]


@pytest.fixture(scope="module")
def hf_scores(tiny_llama_dir: Path) -> Any:
    return hf_log_softmax(tiny_llama_dir)


def _hf_mean_logprob(engine: Engine, hf: Any, prefix: str, choice: str) -> float:
    """The choice's tokens past the prefix's, their mean logprob by Hugging Face."""
    base, full = engine.tokenizer.encode(prefix), engine.tokenizer.encode(prefix + choice)
    common = next(
        (i for i, (a, b) in enumerate(zip(base, full, strict=False)) if a != b),
        min(len(base), len(full)),
    )
    ref = hf(full)
    values = [float(ref[j - 1, full[j]]) for j in range(max(common, 1), len(full))]
    return sum(values) / len(values)


def test_select_takes_the_likeliest_choice_by_hugging_faces_logprobs(
    engine: Engine, backend: rl.EngineBackend, hf_scores: Any
) -> None:
    choices = ["red", "green", "blue sky", "a much longer answer than the others"]
    prefix = "The colour of the sea is "
    scores = [_hf_mean_logprob(engine, hf_scores, prefix, c) for c in choices]
    assert backend.score(prefix, choices) == pytest.approx(scores, abs=1e-4)
    state = rl.ProgramState(backend)
    state += prefix + rl.select("colour", choices)
    assert state["colour"] == choices[max(range(len(choices)), key=scores.__getitem__)]
    assert list(state.meta["colour"]["scores"].values()) == pytest.approx(scores, abs=1e-4)
    assert state.text() == prefix + state["colour"]
    again = rl.ProgramState(backend)
    again += prefix + rl.gen("colour", choices=choices)  # gen(choices=...) is select
    assert again["colour"] == state["colour"]
    with pytest.raises(ValueError, match="method"):
        rl.select("x", ["a"], method="best")


def test_forks_go_on_independently_from_the_shared_prefix(
    engine: Engine, backend: rl.EngineBackend
) -> None:
    s = rl.ProgramState(backend)
    s += "Story:"
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += f" part {i}:"
    forks += rl.gen("next", max_tokens=5, temperature=0)  # the three at once
    for i, branch in enumerate(forks):
        assert branch["next"] == _greedy(engine, f"Story: part {i}:", 5)
    assert s.text() == "Story:"
    assert s.variables == {}


def test_run_batch_gives_each_program_its_own_state_in_order(backend: rl.EngineBackend) -> None:
    questions = ["one?", "two or three?", "a longer question about four?", "five?"]
    batch = answer.run_batch([{"question": q} for q in questions], backend=backend, num_threads=4)
    alone = [answer.run(q, backend=backend) for q in questions]
    assert [s["answer"] for s in batch] == [s["answer"] for s in alone]
    assert [s.text() for s in batch] == [s.text() for s in alone]


def test_the_default_backend(backend: rl.EngineBackend) -> None:
    rl.set_default_backend(None)
    with pytest.raises(rl.LangError, match="no backend"):
        answer.run("q?")
    rl.set_default_backend(backend)
    try:
        assert answer.run("q?")["answer"] == answer.run("q?", backend=backend)["answer"]
    finally:
        rl.set_default_backend(None)


def test_programs_written_wrongly_get_clear_errors(backend: rl.EngineBackend) -> None:
    s = rl.ProgramState(backend)
    with pytest.raises(rl.LangError, match="inside an assistant turn"):
        s += rl.user("hi " + rl.gen("x", max_tokens=2))
    s = rl.ProgramState(backend)
    s += rl.user("hi")
    with pytest.raises(rl.LangError, match="put text inside a turn"):
        s += "loose text"
    with pytest.raises(rl.LangError, match="inside the open"):
        s += rl.assistant(rl.user("nested"))
    s = rl.ProgramState(backend)
    s += "plain text first"
    with pytest.raises(rl.LangError, match="began as plain text"):
        s += rl.user("then a turn")
    with pytest.raises(KeyError, match="no variable 'missing'"):
        s["missing"]
    with pytest.raises(ValueError, match="non-empty strings"):
        rl.select("x", [])
    with pytest.raises(ValueError, match="max_tokens"):
        rl.gen("x", max_tokens=0)
    with pytest.raises(TypeError, match="appends text"):
        s += 42  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # the engine refuses a malformed regex
        s += rl.gen("bad", max_tokens=4, regex="[a-")
