"""A detokenizer that lost its state (a restart) rebuilds it from the worker's history.

The reference is the uninterrupted run: one detokenizer sees every step and the
gateway's assembly folds its deltas. The interrupted run: one detokenizer sees the
first steps, a fresh one the rest; it meets the request mid-way, drops its outputs
until the worker's history (`StepOutputBatch.resent`) comes, decodes it from the start,
and the gateway's assembly skips by the deltas' offsets what it already has. What the
client sees (the update deltas' text), the ids and the usage equal the reference's,
multi-byte characters and stop strings included. The worker's side (`OutputBuilder`)
keeps what it needs for the history, finished choices too, for a bounded while.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from radixserve.api import Assembly, CompletionRequest, parse_body, plan_completion
from radixserve.detok import IncrementalDetokenizer
from radixserve.engine.groups import ChoiceOutput
from radixserve.engine.request import FinishReason as EngineFinish
from radixserve.engine.request import Req, TokenLogprob
from radixserve.engine.sampling.params import SamplingParams
from radixserve.protocol import (
    DetokParams,
    FinishReason,
    LogprobEntry,
    StepOutput,
    StepOutputBatch,
    TextDelta,
    pack_tokens,
    unpack_tokens,
)
from radixserve.worker.convert import OutputBuilder
from radixserve.worker.driver import history_batches
from tests.helpers.tiny_models import embedded_model_dir

TEXTS = [
    "Héllo 😀 wörld 你好 ok 🎉👍🏽 naïve café, the end of it all",
    "日本語のテキスト、絵文字👨‍👩‍👧‍👦と混ざる。À bientôt! 🇫🇷🏳️‍🌈 more",
]
STOP = "STOP"
LENGTH = FinishReason(kind="length")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model_files.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_dir())


def completion_plan(n: int = 1) -> Any:
    body = {"model": "m", "prompt": "x", "n": n, "max_tokens": 500, "stream": True}
    return plan_completion(
        parse_body(CompletionRequest, json.dumps(body).encode()),
        response_id="resp-1",
        gateway_id="gw0",
        served_model="m",
        arrival_time=0.0,
    )


@dataclass
class Choice:
    """One choice as its worker reports it: `chunks` ids per step, its finish last."""

    rid: str
    ids: list[int]
    chunks: list[int]
    finish: FinishReason
    params: DetokParams
    index: int = 0

    def ends(self) -> list[int]:
        out, total = [], 0
        for size in self.chunks:
            total += size
            out.append(total)
        return out

    def output(self, step: int) -> StepOutput | None:
        ends = self.ends()
        if step >= len(ends):
            return None
        lo = ends[step - 1] if step else 0
        return StepOutput(
            rid=self.rid,
            gateway_id="gw0",
            index=self.index,
            new_token_ids=pack_tokens(self.ids[lo : ends[step]]),
            finish_reason=self.finish if step == len(ends) - 1 else None,
            prompt_tokens=3,
            completion_tokens=ends[step],
            detok=self.params if step == 0 else None,
        )

    def history(self, steps: int) -> StepOutput | None:
        """The worker's history after `steps` steps (None before the first)."""
        if steps == 0:
            return None
        ends = self.ends()
        done = min(steps, len(ends))
        return StepOutput(
            rid=self.rid,
            gateway_id="gw0",
            index=self.index,
            new_token_ids=pack_tokens(self.ids[: ends[done - 1]]),
            finish_reason=self.finish if done == len(ends) else None,
            prompt_tokens=3,
            completion_tokens=ends[done - 1],
            detok=self.params,
        )


def batch(step: int, outputs: list[StepOutput | None]) -> StepOutputBatch:
    return StepOutputBatch(worker_id="w0", step=step, outputs=[o for o in outputs if o])


def client_view(plan: Any, deltas: list[TextDelta]) -> tuple[list[str], Assembly]:
    """What the client is sent (each choice's text, from the update deltas) and the
    assembly the gateway ends with."""
    assembly = Assembly(plan)
    texts = [""] * len(assembly.choices)
    for delta in deltas:
        update = assembly.apply(delta)
        if update is not None:
            texts[update.choice.index] += update.delta.text
    return texts, assembly


def uninterrupted(tokenizer: Any, choices: list[Choice]) -> list[TextDelta]:
    detok = IncrementalDetokenizer(tokenizer)
    steps = max(len(c.chunks) for c in choices)
    deltas = []
    for step in range(steps):
        out = detok.process(batch(step, [c.output(step) for c in choices]))
        deltas += out.get("gw0", [])
    return deltas


def interrupted(tokenizer: Any, choices: list[Choice], kill: int, resend: int) -> list[TextDelta]:
    """The first detokenizer sees steps [0, kill); a fresh one the rest, with the
    history coming after step `resend` - 1 (before step `resend`)."""
    old, new = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
    steps = max(len(c.chunks) for c in choices)
    deltas = []
    for step in range(steps + 1):
        if step == resend:
            resent = [h for c in choices if (h := c.history(resend)) is not None]
            history = StepOutputBatch(worker_id="w0", step=step, resent=resent)
            deltas += new.process(history).get("gw0", [])
        if step < steps:
            detok = old if step < kill else new
            deltas += detok.process(batch(step, [c.output(step) for c in choices])).get("gw0", [])
    assert new.take_lost() == []
    assert len(new) == 0  # every stream finished
    # It asked once, for the request it met mid-way (none when the history came first).
    asked = {o.rid for c in choices for step in range(kill, resend) if (o := c.output(step))}
    asked = asked if kill > 0 else set()  # (every choice here starts at step 0)
    assert new.take_resyncs() == sorted(asked)
    assert any(d.resent and d.text_offset == 0 for d in deltas)
    return deltas


def random_chunks(count: int, rng: random.Random) -> list[int]:
    chunks = []
    while count > 0:
        size = min(rng.randint(1, 3), count)
        chunks.append(size)
        count -= size
    return chunks


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [False, True])
def test_a_rebuilt_stream_shows_the_client_what_the_uninterrupted_one_does(
    tokenizer: Any, text: str, stop: bool
) -> None:
    rng = random.Random(f"{text}/{stop}")  # the same chunks every run
    ids = tokenizer.encode(text + (f" {STOP} after" if stop else ""))
    finish = FinishReason(kind="stop", matched=STOP) if stop else LENGTH
    params = DetokParams(stop=[STOP] if stop else [])
    choice = Choice("r0", ids, random_chunks(len(ids), rng), finish, params)
    plan = completion_plan()
    choice.rid = plan.rids[0]
    reference, whole = client_view(plan, uninterrupted(tokenizer, [choice]))
    assert reference[0] == (f"{text} " if stop else tokenizer.decode(ids))
    steps = len(choice.chunks)
    cases = [(0, 1), (1, 1), (2, 5), (steps // 2, steps // 2 + 3), (3, steps), (steps - 1, steps)]
    for kill, resend in cases:
        texts, assembly = client_view(plan, interrupted(tokenizer, [choice], kill, resend))
        assert texts == reference, (kill, resend)
        (got,) = assembly.choices
        assert got.token_ids == ids and got.finish == finish
        assert assembly.usage() == whole.usage()


def test_choices_of_one_request_are_rebuilt_each_finished_or_not(tokenizer: Any) -> None:
    plan = completion_plan(n=2)
    rid = plan.rids[0]
    params = DetokParams()
    a, b = tokenizer.encode(TEXTS[0]), tokenizer.encode(TEXTS[1])
    choices = [
        Choice(rid, a[:6], [1] * 6, LENGTH, params, index=0),  # finishes before the restart
        Choice(rid, b, [2] * (len(b) // 2) + [len(b) % 2] * (len(b) % 2), LENGTH, params, 1),
    ]
    reference, whole = client_view(plan, uninterrupted(tokenizer, choices))
    for kill, resend in [(4, 9), (7, 9), (8, len(choices[1].chunks))]:
        texts, assembly = client_view(plan, interrupted(tokenizer, choices, kill, resend))
        assert texts == reference, (kill, resend)
        assert [c.token_ids for c in assembly.choices] == [a[:6], b]
        assert assembly.usage() == whole.usage()


def test_the_assembly_skips_what_a_choice_already_has(tokenizer: Any) -> None:
    plan = completion_plan()
    rid = plan.rids[0]
    assembly = Assembly(plan)

    def entry(token_id: int) -> LogprobEntry:
        return LogprobEntry(token_id=token_id, token=str(token_id), logprob=-1.0)

    first = TextDelta(
        rid=rid,
        text="abc",
        token_ids=pack_tokens([1, 2]),
        completion_tokens=2,
        text_offset=0,
        token_offset=0,
        logprobs=[entry(1), entry(2)],
    )
    assert assembly.apply(first) is not None
    again = TextDelta(
        rid=rid,
        text="abcde",
        token_ids=pack_tokens([1, 2, 3]),
        completion_tokens=3,
        text_offset=0,
        token_offset=0,
        logprobs=[entry(1), entry(2), entry(3)],
        resent=True,
    )
    update = assembly.apply(again)
    assert update is not None
    assert (update.delta.text, unpack_tokens(update.delta.token_ids)) == ("de", [3])
    assert [e.token_id for e in update.delta.logprobs or []] == [3]
    (choice,) = assembly.choices
    assert (choice.text, choice.token_ids, choice.completion_tokens) == ("abcde", [1, 2, 3], 3)
    assert [e.token_id for e in choice.logprobs] == [1, 2, 3]
    # All of it already here: no update; a delta without offsets is appended as is.
    assert assembly.apply(again) is None
    plain = TextDelta(rid=rid, text="f", token_ids=pack_tokens([4]), completion_tokens=4)
    assert assembly.apply(plain) is not None
    assert (choice.text, choice.token_ids) == ("abcdef", [1, 2, 3, 4])


def test_the_worker_keeps_each_choices_history_finished_ones_for_a_while() -> None:
    now = [0.0]
    builder = OutputBuilder(recent_s=30.0, recent_max=2, clock=lambda: now[0])
    params = SamplingParams.from_dict({"n": 2, "stop": ["x"], "return_logprob": True})
    builder.track("r0", "gw0", 2, resumable=True)
    reqs = [Req("r0", [1, 2, 3], params, 0, frozenset()) for _ in range(2)]

    def step(index: int, new: list[int], finish: EngineFinish | None = None) -> StepOutput:
        req = reqs[index]
        req.output_ids += new
        req.logprobs += [TokenLogprob(t, -0.5) for t in new]
        req.finish_reason = finish
        out = builder.build(ChoiceOutput("r0", index, req, new, req.logprobs[-len(new) :]))
        assert out is not None
        return out

    assert builder.history() == []  # nothing sent yet
    step(0, [7, 8])
    step(1, [9])
    step(0, [10], EngineFinish("length"))
    step(1, [11])
    history = builder.history(["r0"])
    assert [(h.index, unpack_tokens(h.new_token_ids)) for h in history] == [
        (0, [7, 8, 10]),
        (1, [9, 11]),
    ]
    assert [h.completion_tokens for h in history] == [3, 2]
    assert history[0].finish_reason == FinishReason(kind="length") and not history[1].finish_reason
    assert all(h.detok is not None and h.detok.resumable and h.detok.stop == ["x"] for h in history)
    assert history[1].token_logprobs == [-0.5, -0.5]
    assert builder.history(["other"]) == []
    step(1, [12], EngineFinish("stop", matched="x"))  # the request is done: both kept
    assert [h.index for h in builder.history()] == [0, 1]
    now[0] = 31.0
    assert builder.history() == []  # past recent_s


def test_a_long_history_goes_out_in_batches_under_the_payload_bound() -> None:
    outputs = [
        StepOutput(rid=f"r{i}", gateway_id="gw0", new_token_ids=pack_tokens(list(range(1000))))
        for i in range(10)
    ]
    batches = history_batches(outputs, max_bytes=9000)  # two outputs of ~4 kB a batch
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2]
    assert [out for b in batches for out in b] == outputs
    assert [len(b) for b in history_batches(outputs, max_bytes=10)] == [1] * 10
    assert history_batches([]) == []
