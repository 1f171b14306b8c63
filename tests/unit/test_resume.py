"""Resuming a request from the tokens another worker generated (issue 56): a run cut at
output position k and resumed on a new engine with its first k tokens gives exactly the
uninterrupted run's tokens, finish reason and token counts, for greedy and seeded
sampling, penalties, min_new_tokens, grammars and logprobs; a request of n choices
resumes each unfinished choice after its own tokens and runs no finished one; the
worker's conversion (a `RoutedRequest` with `output_prefix`, or `choice_prefixes` for
n > 1) feeds the engine the same way.

References: the uninterrupted run on its own engine; `jsonschema` for validity.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry import trace

from radixserve import Engine, protocol
from radixserve.engine.request import FinishReason, Req
from radixserve.engine.sampling.params import SamplingParams
from radixserve.protocol import decode, encode, pack_tokens
from radixserve.telemetry.common import ServiceMetrics
from radixserve.worker.convert import OutputBuilder, engine_params
from radixserve.worker.driver import EngineDriver
from radixserve.worker.metrics import WorkerMetrics, WorkerTelemetry
from tests.helpers.structured_cases import JSON_SCHEMAS, check_json
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 20
# A schema whose greedy answer here takes several steps, some of them jump-forwards.
PERSON_SCHEMA = JSON_SCHEMAS[3]


def _engine(model_dir: Path) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        debug_check_invariants=True,
    )


@pytest.fixture(scope="module")
def first(tiny_llama_dir: Path) -> Any:
    """The engine of the uninterrupted runs (the worker that later dies)."""
    engine = _engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def second(tiny_llama_dir: Path) -> Any:
    """The engine that resumes; its cache is emptied before each resume."""
    engine = _engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@dataclass
class Run:
    """One request, step by step, as the worker would publish it."""

    outputs: list[protocol.StepOutput] = field(default_factory=list)
    req: Req | None = None

    @property
    def chunks(self) -> list[list[int]]:
        return [o.new_token_ids_list for o in self.outputs]

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def last(self) -> protocol.StepOutput:
        return self.outputs[-1]

    def boundaries(self) -> list[int]:
        """Output counts at the end of each published step but the last."""
        counts, total = [], 0
        for chunk in self.chunks[:-1]:
            total += len(chunk)
            counts.append(total)
        return [c for c in counts if c > 0]


def run(
    engine: Engine,
    prompt: list[int],
    params: dict[str, Any] | SamplingParams,
    resume: list[int] | None = None,
    rid: str = "r",
) -> Run:
    """Submit and step until the request finishes, converting each step's output as the
    worker does, and check every message continues the stream the detokenizer saw."""
    builder = OutputBuilder()
    builder.track(rid, "gw", 1)
    engine.submit(prompt, params, rid=rid, resume_ids=resume)
    result = Run()
    received = len(resume or ())
    for _ in range(4 * MAX_NEW + 64):  # a bound, not a wait: each step does work
        for choice in engine.step():
            result.req = choice.req
            out = builder.build(choice)
            assert out is not None
            new = len(out.new_token_ids_list)
            # What the detokenizer checks: the totals continue what it received.
            assert out.completion_tokens - new == received
            assert out.prompt_tokens == len(prompt)
            received += new
            result.outputs.append(out)
        if result.outputs and result.last.finish_reason is not None:
            assert engine.num_tracked() == 0
            return result
    raise AssertionError("the request did not finish")


def split_and_resume(
    first: Engine, second: Engine, prompt: list[int], params: dict[str, Any], k: int | None = None
) -> tuple[Run, Run, int]:
    """The uninterrupted run, and a run on `second` resumed from its first k tokens (the
    middle step boundary when k is None)."""
    whole = run(first, prompt, params, rid="whole")
    if k is None:
        cuts = whole.boundaries()
        assert cuts, "the run finished in one step"
        k = cuts[len(cuts) // 2]
    assert 0 < k < len(whole.tokens)
    assert second.flush_cache()
    resumed = run(second, prompt, params, resume=whole.tokens[:k], rid="resumed")
    return whole, resumed, k


def assert_continues(whole: Run, resumed: Run, k: int) -> None:
    assert whole.tokens[:k] + resumed.tokens == whole.tokens
    assert resumed.last.finish_reason == whole.last.finish_reason
    assert resumed.last.completion_tokens == whole.last.completion_tokens == len(whole.tokens)
    assert resumed.last.prompt_tokens == whole.last.prompt_tokens
    assert resumed.last.cached_tokens == 0  # the resuming engine's cache was empty


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"temperature": 0.0}, id="greedy"),
        pytest.param({"temperature": 1.0, "top_p": 0.9, "seed": 1234}, id="seeded"),
        pytest.param(
            {
                "temperature": 1.0,
                "top_k": 50,
                "seed": 99,
                "frequency_penalty": 0.8,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.3,
            },
            id="penalties",
        ),
    ],
)
@pytest.mark.parametrize("k", [1, 7, MAX_NEW - 1])
def test_a_resumed_run_continues_the_uninterrupted_one(
    first: Engine, second: Engine, params: dict[str, Any], k: int
) -> None:
    (prompt,) = make_prompts(first.runner.vocab_size, [9], seed=k)
    full = {"max_new_tokens": MAX_NEW, "ignore_eos": True, **params}
    whole, resumed, k = split_and_resume(first, second, prompt, full, k)
    assert_continues(whole, resumed, k)
    assert whole.last.finish_reason is not None and whole.last.finish_reason.kind == "length"
    assert len(resumed.tokens) == MAX_NEW - k  # max_new_tokens counts the resumed ones


def test_penalties_count_the_resumed_tokens(first: Engine, second: Engine) -> None:
    """A strong repetition penalty: were the resumed tokens prompt, or nothing, the
    penalty would see other counts; the output differs from the run without it."""
    (prompt,) = make_prompts(first.runner.vocab_size, [6], seed=21)
    base = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.0}
    penalized = {**base, "frequency_penalty": 2.0, "presence_penalty": 1.0}
    whole, resumed, k = split_and_resume(first, second, prompt, penalized, k=10)
    assert_continues(whole, resumed, k)
    plain = run(first, prompt, base, rid="plain")
    assert plain.tokens != whole.tokens  # the penalty matters on this prompt


def test_min_new_tokens_counts_the_resumed_tokens(first: Engine, second: Engine) -> None:
    """A stop token the run emits at position 5, with min_new_tokens = 5: it ends the run
    there. Resumed after 3 tokens, the stop is allowed at 5 only if the 3 count toward
    min_new_tokens (else it is held back to position 8 and the runs part)."""
    (prompt,) = make_prompts(first.runner.vocab_size, [8], seed=31)
    greedy = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.0}
    probe = run(first, prompt, greedy, rid="probe").tokens
    stop = probe[5]
    assert stop not in probe[:5]  # so the run below agrees with the probe up to there
    params = {**greedy, "stop_token_ids": [stop], "min_new_tokens": 5}
    whole, resumed, k = split_and_resume(first, second, prompt, params, k=3)
    assert_continues(whole, resumed, k)
    assert whole.tokens == probe[:6]
    assert whole.last.finish_reason == protocol.FinishReason(kind="stop", matched=stop)


def test_resume_ids_ending_in_a_stop_token_go_on(second: Engine) -> None:
    """The scheduler resumes unfinished requests only, so a stop token at the end of
    resume_ids is output, not the end: the request generates what it would without that
    token being a stop token, until a stop token comes again."""
    (prompt,) = make_prompts(second.runner.vocab_size, [8], seed=33)
    resume = make_prompts(second.runner.vocab_size, [4], seed=34)[0]
    greedy = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.0}
    plain = run(second, prompt, greedy, resume=resume, rid="plain")
    stopping = run(second, prompt, {**greedy, "stop_token_ids": [resume[-1]]}, resume=resume)
    assert stopping.tokens, "finished on the resumed stop token"
    assert stopping.tokens == plain.tokens[: len(stopping.tokens)]


def test_a_grammar_constrained_request_replays_and_continues(first: Engine, second: Engine) -> None:
    prompt = first.tokenizer.encode("Answer:")
    params = {"json_schema": json.dumps(PERSON_SCHEMA), "max_new_tokens": 96, "temperature": 0}
    whole, resumed, k = split_and_resume(first, second, prompt, params)
    assert_continues(whole, resumed, k)
    assert whole.last.finish_reason is not None and whole.last.finish_reason.kind == "stop"
    check_json(first.tokenizer.decode(whole.tokens, skip_special_tokens=True), PERSON_SCHEMA)


def test_resumed_at_the_length_limit_finishes_at_once(second: Engine) -> None:
    (prompt,) = make_prompts(second.runner.vocab_size, [5], seed=41)
    done = make_prompts(second.runner.vocab_size, [MAX_NEW], seed=42)[0]
    out = run(second, prompt, {"max_new_tokens": MAX_NEW}, resume=done)
    assert len(out.outputs) == 1 and out.tokens == []
    assert out.last.finish_reason == protocol.FinishReason(kind="length")
    assert out.last.completion_tokens == MAX_NEW
    assert out.req is not None and out.req.output_ids == done


def test_resumed_with_a_complete_grammar_finishes_at_once(second: Engine) -> None:
    """Nothing can follow a grammar the resumed tokens complete (no stop tokens: it ends
    when complete), as the uninterrupted run ended on them: "stop", no new tokens."""
    answer = second.tokenizer.encode("yes", add_special_tokens=False)
    params = {"max_new_tokens": 8, "regex": "(yes|no)", "ignore_eos": True}
    out = run(second, second.tokenizer.encode("Answer:"), params, resume=answer)
    assert out.tokens == [] and out.last.completion_tokens == len(answer)
    assert out.last.finish_reason == protocol.FinishReason(kind="stop")


def test_logprobs_are_of_the_new_tokens_and_the_prompt_is_not_scored_again(
    first: Engine, second: Engine
) -> None:
    (prompt,) = make_prompts(first.runner.vocab_size, [7], seed=51)
    params = {
        "max_new_tokens": 12,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
    }
    whole, resumed, k = split_and_resume(first, second, prompt, params, k=5)
    assert_continues(whole, resumed, k)
    assert whole.outputs[0].prompt_logprobs is not None  # the first worker sent them
    assert all(o.prompt_logprobs is None for o in resumed.outputs)

    def logprobs(r: Run) -> list[float]:
        return [lp for o in r.outputs for lp in o.token_logprobs or []]

    ours, reference = logprobs(resumed), logprobs(whole)[k:]
    assert len(ours) == len(resumed.tokens) == len(reference)
    # Prefill of prompt + k tokens against the reference's decode steps: float rounding.
    assert ours == pytest.approx(reference, abs=1e-4)
    assert resumed.req is not None and len(resumed.req.logprobs) == len(resumed.tokens)


def test_cached_tokens_are_the_prompt_this_engine_held(first: Engine) -> None:
    """Resumed where the prompt (and its outputs) are cached: the prompt's tokens are the
    cache hit, not the resumed outputs it also held."""
    (prompt,) = make_prompts(first.runner.vocab_size, [11], seed=61)
    params = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    whole = run(first, prompt, params, rid="whole")
    resumed = run(first, prompt, params, resume=whole.tokens[:6], rid="again")
    assert whole.tokens[:6] + resumed.tokens == whole.tokens
    assert resumed.last.cached_tokens == len(prompt)


def test_bad_resume_ids_are_a_clear_error(second: Engine) -> None:
    vocab = second.runner.vocab_size
    (prompt,) = make_prompts(vocab, [5], seed=71)
    cases: list[tuple[dict[str, Any], list[int], str]] = [
        ({"max_new_tokens": 8}, [5, vocab], "resume_ids are not output token ids"),
        ({"max_new_tokens": 8}, [-1], "resume_ids are not output token ids"),
        ({"max_new_tokens": 2}, [5, 6, 7], "resume_ids has 3 tokens; max_new_tokens is 2"),
        ({"max_new_tokens": 8, "n": 2}, [5], "n == 1 requests only"),
        (
            {"max_new_tokens": 8, "json_schema": json.dumps(PERSON_SCHEMA)},
            second.tokenizer.encode("hello", add_special_tokens=False),
            r"resume_ids\[0\] \(token \d+\) is not accepted by the request's grammar",
        ),
    ]
    for params, resume, message in cases:
        with pytest.raises(ValueError, match=message):
            second.submit(prompt, params, rid="bad", resume_ids=resume)
    assert second.num_tracked() == 0 and not second.has_work()


def test_more_than_the_context_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "short", seed=4, max_position_embeddings=32)
    with Engine(model_path=str(model), device="cpu", dtype="float32") as engine:
        (prompt,) = make_prompts(engine.runner.vocab_size, [20], seed=81)
        with pytest.raises(ValueError, match="the prompt and resume_ids have 33 tokens"):
            engine.submit(prompt, {"max_new_tokens": 64}, resume_ids=prompt[:13])
        # At the context exactly the uninterrupted run ended: so does this one.
        out = run(engine, prompt, {"max_new_tokens": 64}, resume=prompt[:12])
        assert out.tokens == [] and out.last.completion_tokens == 12
        assert out.last.finish_reason is not None and out.last.finish_reason.kind == "length"


@pytest.mark.slow
def test_tensor_parallel_ranks_resume_alike(first: Engine, tiny_llama_dir: Path) -> None:
    """Two ranks (gloo): every rank builds the resumed request from rank 0's ReqSpec, its
    grammar replayed too, so the ranks stay in step and continue the one-rank run."""
    vocab = first.runner.vocab_size
    cases: list[tuple[list[int], dict[str, Any]]] = [
        (
            make_prompts(vocab, [9], seed=101)[0],
            {
                "max_new_tokens": MAX_NEW,
                "ignore_eos": True,
                "temperature": 1.0,
                "top_p": 0.9,
                "seed": 5,
                "frequency_penalty": 0.5,
            },
        ),
        (
            first.tokenizer.encode("Answer:"),
            {"max_new_tokens": 64, "json_schema": json.dumps(PERSON_SCHEMA), "temperature": 0},
        ),
    ]
    with Engine(
        str(tiny_llama_dir), tp_size=2, device="cpu", dtype="float32", max_total_tokens=2048
    ) as two:
        for prompt, params in cases:
            assert two.flush_cache()
            whole, resumed, k = split_and_resume(first, two, prompt, params)
            assert_continues(whole, resumed, k)


# -- the worker's path ------------------------------------------------------------------------


def routed(
    rid: str,
    prompt: list[int],
    sampling: protocol.SamplingParams,
    prefix: list[int] | None,
    choices: list[list[int] | None] | None = None,
) -> protocol.RoutedRequest:
    """A re-routed request as the worker decodes it off the wire (`choices`: each
    choice's tokens, None for a finished one, for n > 1)."""
    request = protocol.TokenizedRequest(
        rid=rid, gateway_id="gw-1", input_ids=pack_tokens(prompt), sampling=sampling
    )
    message = protocol.RoutedRequest(
        request=request,
        worker_id="w-1",
        attempt=1,
        output_prefix=None if prefix is None else pack_tokens(prefix),
        choice_prefixes=(
            None if choices is None else [None if c is None else pack_tokens(c) for c in choices]
        ),
    )
    return decode(encode(message), protocol.RoutedRequest)


class Published:
    """What the driver publishes and rejects, with a wait for a rid's last outputs."""

    def __init__(self) -> None:
        self.outputs: list[protocol.StepOutput] = []
        self.rejected: list[protocol.RequestError] = []
        self._changed = threading.Condition()

    def on_step(self, step: int, outputs: list[protocol.StepOutput]) -> None:
        with self._changed:
            self.outputs.extend(outputs)
            self._changed.notify_all()

    def on_reject(self, error: protocol.RequestError, gateway_id: str) -> None:
        with self._changed:
            self.rejected.append(error)
            self._changed.notify_all()

    def of(self, rid: str, choices: int = 1) -> list[protocol.StepOutput]:
        """`rid`'s outputs once `choices` of its choices have finished (or it was refused)."""

        def over() -> bool:
            ends = sum(1 for o in self.outputs if o.rid == rid and o.finish_reason is not None)
            return ends >= choices or any(e.rid == rid for e in self.rejected)

        with self._changed:
            assert self._changed.wait_for(over, timeout=60), f"{rid} never finished"
            return [o for o in self.outputs if o.rid == rid]


def test_the_worker_resumes_a_routed_request_with_its_output_prefix(
    first: Engine, second: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    (prompt,) = make_prompts(first.runner.vocab_size, [9], seed=91)
    sampling = protocol.SamplingParams(
        max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
    )
    whole = run(first, prompt, engine_params(sampling), rid="whole")
    k = 8
    metrics = WorkerMetrics(ServiceMetrics("worker", "w-1"), "w-1")
    published = Published()
    assert second.flush_cache()
    driver = EngineDriver(
        second,
        on_step=published.on_step,
        on_reject=published.on_reject,
        telemetry=WorkerTelemetry(metrics, trace.get_tracer("test")),
    )
    driver.start()
    try:
        with caplog.at_level(logging.INFO, logger="radixserve.worker.driver"):
            driver.submit(routed("moved", prompt, sampling, whole.tokens[:k]))
            outputs = published.of("moved")
            driver.submit(routed("bad", prompt, sampling, [first.runner.vocab_size]))
            assert published.of("bad") == []
            gone = routed("gone", prompt, sampling, whole.tokens[:k])
            driver.abort_unsubmitted(gone)
            (aborted,) = published.of("gone")
    finally:
        driver.stop()
    assert driver.error is None
    received = k
    for out in outputs:  # the stream the detokenizer saw goes on from the k tokens
        assert out.completion_tokens - len(out.new_token_ids_list) == received
        received += len(out.new_token_ids_list)
    assert whole.tokens[:k] + [t for o in outputs for t in o.new_token_ids_list] == whole.tokens
    assert outputs[-1].finish_reason == whole.last.finish_reason
    assert outputs[-1].completion_tokens == MAX_NEW and outputs[-1].prompt_tokens == len(prompt)
    (error,) = published.rejected
    assert error.rid == "bad" and error.http_status == 400
    assert "resume_ids are not output token ids" in error.message
    assert aborted.completion_tokens == k and aborted.finish_reason is not None
    assert aborted.finish_reason.kind == "abort"
    resumed_logs = [r for r in caplog.records if "resumed after" in r.getMessage()]
    assert [(r.levelno, getattr(r, "rid", None)) for r in resumed_logs] == [(logging.INFO, "moved")]
    assert "resumed after 8 generated tokens (attempt 1)" in resumed_logs[0].getMessage()
    sample = metrics.common.registry.get_sample_value(
        "radixserve:worker_resumed_requests_total", {"worker": "w-1"}
    )
    assert sample == 1  # the refused one is not counted


# -- n > 1: each unfinished choice resumed after its own tokens --------------------------------


def run_choices(
    engine: Engine,
    prompt: list[int],
    params: dict[str, Any],
    resume: dict[int, list[int]] | None = None,
    rid: str = "r",
) -> dict[int, Run]:
    """`run` for a request of n choices: each choice's outputs by index (only the ones
    `resume` names, when given), each checked to continue its own count."""
    running = sorted(resume) if resume is not None else list(range(params["n"]))
    builder = OutputBuilder()
    builder.track(rid, "gw", len(running))
    engine.submit(prompt, params, rid=rid, resume_choices=resume)
    runs = {index: Run() for index in running}
    received = {index: len((resume or {}).get(index, ())) for index in running}
    for _ in range(4 * MAX_NEW + 64):  # a bound, not a wait: each step does work
        for choice in engine.step():
            out = builder.build(choice)
            assert out is not None and out.index in runs, "a choice it was not to run"
            new = len(out.new_token_ids_list)
            assert out.completion_tokens - new == received[out.index]
            received[out.index] += new
            runs[out.index].req = choice.req
            runs[out.index].outputs.append(out)
        if all(r.outputs and r.last.finish_reason is not None for r in runs.values()):
            assert engine.num_tracked() == 0 and len(builder) == 0
            return runs
    raise AssertionError("the request did not finish")


N_CHOICES = 3


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"temperature": 0.0}, id="greedy"),
        pytest.param({"temperature": 1.0, "top_p": 0.9, "seed": 4321}, id="seeded"),
    ],
)
@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param({1: 4, 2: 13}, id="two-cut"),
        pytest.param({0: 0, 2: MAX_NEW}, id="one-fresh-one-at-its-limit"),
    ],
)
def test_n_choices_resume_each_after_its_own_tokens(
    first: Engine, second: Engine, params: dict[str, Any], cuts: dict[int, int]
) -> None:
    """Choice i samples with seed + i: resumed after its own first k_i tokens (each a
    different k), it continues as uninterrupted; a choice not named (finished on the
    first worker) is neither run nor reported again."""
    (prompt,) = make_prompts(first.runner.vocab_size, [9], seed=111)
    full = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "n": N_CHOICES, **params}
    whole = run_choices(first, prompt, full, rid="whole")
    if "seed" in params:  # each choice its own draws
        assert len({tuple(r.tokens) for r in whole.values()}) == N_CHOICES
    assert second.flush_cache()
    resume = {index: whole[index].tokens[:k] for index, k in cuts.items()}
    resumed = run_choices(second, prompt, full, resume=resume, rid="resumed")
    assert sorted(resumed) == sorted(cuts)
    for index, k in cuts.items():
        ours, reference = resumed[index], whole[index]
        assert reference.tokens[:k] + ours.tokens == reference.tokens
        assert len(ours.tokens) == MAX_NEW - k
        assert ours.last.finish_reason == reference.last.finish_reason
        assert ours.last.completion_tokens == reference.last.completion_tokens == MAX_NEW
        assert ours.last.prompt_tokens == len(prompt)


def test_bad_resume_choices_are_a_clear_error(second: Engine) -> None:
    vocab = second.runner.vocab_size
    (prompt,) = make_prompts(vocab, [5], seed=72)
    params = {"max_new_tokens": 4, "n": 2}
    cases: list[tuple[Any, str]] = [
        ({}, "resume_choices names no choice to run"),
        ({2: [5]}, r"resume_choices has choice 2; the request's choices are 0\.\.1 \(n = 2\)"),
        ({-1: [5]}, "resume_choices has choice -1"),
        ({True: [5]}, "resume_choices has choice True"),
        ([[5], [6]], "resume_choices must map choice indices to output token ids"),
        ({1: [5, vocab]}, r"resume_choices\[1\] are not output token ids"),
        ({0: [], 1: [5] * 5}, r"resume_choices\[1\]: resume_ids has 5 tokens; max_new_tokens"),
    ]
    for resume, message in cases:
        with pytest.raises(ValueError, match=message):
            second.submit(prompt, params, rid="bad", resume_choices=resume)
    with pytest.raises(ValueError, match="resume_ids or resume_choices, not both"):
        second.submit(prompt, params, rid="bad", resume_ids=[5], resume_choices={0: [5]})
    assert second.num_tracked() == 0 and not second.has_work()


def test_an_abort_ends_the_resumed_choices_under_their_indices(second: Engine) -> None:
    (prompt,) = make_prompts(second.runner.vocab_size, [6], seed=73)
    params = {"max_new_tokens": 8, "n": 3, "ignore_eos": True}
    second.submit(prompt, params, rid="cut", resume_choices={1: [5, 6], 2: []})
    assert second.abort("cut")
    ends = [(out.index, out.req.finish_reason) for out in second.step()]
    abort = FinishReason("abort", message="aborted")
    assert sorted(ends) == [(1, abort), (2, abort)]  # waiting on the shared prefill still
    assert second.num_tracked() == 0 and not second.has_work()


def test_the_worker_resumes_only_the_unfinished_choices(first: Engine, second: Engine) -> None:
    """A `RoutedRequest` with `choice_prefixes` (choice 0 finished, 1 and 2 cut): the
    driver publishes choices 1 and 2 only, each from its own count, and ends the request
    after them; an abort before the engine had it answers for those two, with their
    counts."""
    (prompt,) = make_prompts(first.runner.vocab_size, [9], seed=92)
    sampling = protocol.SamplingParams(
        max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True, n=3
    )
    whole = run_choices(first, prompt, msgspec.structs.asdict(sampling), rid="whole")
    cut = {1: 5, 2: 9}
    choices: list[list[int] | None] = [None, *(whole[i].tokens[:k] for i, k in cut.items())]
    published = Published()
    assert second.flush_cache()
    driver = EngineDriver(second, on_step=published.on_step, on_reject=published.on_reject)
    driver.start()
    try:
        driver.submit(routed("moved", prompt, sampling, None, choices))
        outputs = published.of("moved", choices=2)
        gone = routed("gone", prompt, sampling, None, choices)
        driver.abort_unsubmitted(gone)
        aborted = published.of("gone", choices=2)
    finally:
        driver.stop()
    assert driver.error is None and published.rejected == [] and driver.num_tracked == 0
    assert {out.index for out in outputs} == {1, 2}
    for index, k in cut.items():
        mine = [out for out in outputs if out.index == index]
        assert whole[index].tokens[:k] + [t for o in mine for t in o.new_token_ids_list] == (
            whole[index].tokens
        )
        assert mine[0].completion_tokens - len(mine[0].new_token_ids_list) == k
        assert mine[-1].finish_reason == whole[index].last.finish_reason
    assert [(out.index, out.completion_tokens) for out in aborted] == [(1, 5), (2, 9)]
    assert all(out.finish_reason is not None for out in aborted)
