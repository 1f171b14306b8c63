"""radixserve.detok with the real SmolLM2 tokenizer: streamed text equals the tokenizer's
own decode of the whole output, split characters arrive whole, stop strings never leak."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from radixserve.detok import (
    REPLACEMENT_CHAR,
    DecodeStatus,
    IncrementalDetokenizer,
    StepGaps,
    decode_step,
    stop_prefix_len,
    trim_stop_string,
)
from radixserve.protocol import (
    DetokParams,
    FinishReason,
    StepOutput,
    StepOutputBatch,
    TextDelta,
    TopLogprobs,
    num_tokens,
    pack_tokens,
)
from tests.helpers.tiny_models import embedded_model_dir

TEXTS = [
    "Héllo 😀 wörld 你好 <|im_end|> ok 🎉👍🏽 naïve café",
    "日本語のテキスト、絵文字👨‍👩‍👧‍👦と混ざる。<|im_start|>assistant\nÀ bientôt!",
    "Ünïcödé: Ελληνικά, русский, العربية 🇫🇷🏳️‍🌈<|endoftext|>\n\n  end",
]
LENGTH = FinishReason(kind="length")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model_files.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_dir())


def step_output(
    ids: Sequence[int],
    finish: FinishReason | None = None,
    rid: str = "r0",
    gateway_id: str = "gw0",
    detok: DetokParams | None = None,
    sent_before: int = 0,
    **fields: Any,
) -> StepOutput:
    """One output; its `completion_tokens` (the worker's total) counts `sent_before`
    tokens of the stream's earlier outputs plus these."""
    fields.setdefault("completion_tokens", sent_before + len(ids))
    return StepOutput(
        rid=rid,
        gateway_id=gateway_id,
        new_token_ids=pack_tokens(list(ids)),
        finish_reason=finish,
        detok=detok,
        **fields,
    )


def stream(
    detok: IncrementalDetokenizer,
    chunks: Sequence[Sequence[int]],
    params: DetokParams,
    finish: FinishReason | None = LENGTH,
) -> list[str]:
    """Feed one stream's chunks, one step batch each; the last chunk carries `finish`."""
    texts = []
    sent = 0
    for step, chunk in enumerate(chunks):
        last = step == len(chunks) - 1
        first = params if step == 0 else None
        out = step_output(chunk, finish if last else None, detok=first, sent_before=sent)
        sent += len(chunk)
        (delta,) = detok.process(StepOutputBatch(worker_id="w0", step=step, outputs=[out]))["gw0"]
        texts.append(delta.text)
    return texts


def one_at_a_time(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_adds_up_to_the_full_decode(
    tokenizer: Any, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    # Plain tokenizer joins as the reference (the spaced form has its own test).
    params = DetokParams(
        skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False
    )
    deltas = stream(detok, one_at_a_time(ids), params)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert len(detok) == 0, "a finished stream must not keep state"


def test_random_chunks_and_stop_strings_match_the_reference(tokenizer: Any) -> None:
    """Steps of 1-4 ids, a stop string cut from the text: the streamed text is the full
    decode up to the stop string, whatever the chunking."""
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(10):
            start = rng.randrange(1, len(full) - 4)
            stop = full[start : start + rng.randint(2, 4)]
            chunks, pos = [], 0
            while pos < len(ids):
                size = rng.randint(1, 4)
                chunks.append(ids[pos : pos + size])
                pos += size
            # As the engine does: finish at the first step whose text holds the stop string.
            end = next(
                n
                for n in range(1, len(chunks) + 1)
                if stop in tokenizer.decode([i for c in chunks[:n] for i in c])
            )
            deltas = stream(
                IncrementalDetokenizer(tokenizer),
                chunks[:end],
                DetokParams(stop=[stop]),
                FinishReason(kind="stop", matched=stop),
            )
            assert "".join(deltas) == full[: full.find(stop)], (text, stop)
            assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_a_character_split_across_tokens_arrives_whole(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 你好 done")
    # The first id whose text alone is a broken character: 你 spans more than one token.
    split = next(k for k, i in enumerate(ids) if tokenizer.decode([i]).endswith(REPLACEMENT_CHAR))
    assert tokenizer.decode(ids[: split + 1]).endswith(REPLACEMENT_CHAR)
    deltas = stream(IncrementalDetokenizer(tokenizer), one_at_a_time(ids), DetokParams())
    assert deltas[split] == "", "a partial character must be held back"
    assert [d for d in deltas if "你" in d] == ["你"], "the character comes whole, in one delta"
    assert "".join(deltas) == "ok 你好 done"


def test_whole_characters_before_a_split_one_go_out_at_once(tokenizer: Any) -> None:
    ids = tokenizer.encode(" abc😀")
    split = next(k for k, i in enumerate(ids) if tokenizer.decode([i]).endswith(REPLACEMENT_CHAR))
    # One step with everything up to and including the first byte of the emoji.
    deltas = stream(
        IncrementalDetokenizer(tokenizer), [ids[: split + 1], ids[split + 1 :]], DetokParams()
    )
    assert deltas == [tokenizer.decode(ids[:split]), "😀"]


def test_a_stop_string_split_over_two_steps_never_leaks(tokenizer: Any) -> None:
    text = "Hello world. The end is near, my friend."
    ids = tokenizer.encode(text)
    stop = "end is"
    # The stop string really spans two tokens here.
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    upto = next(n for n in range(len(ids)) if stop in tokenizer.decode(ids[: n + 1])) + 1
    params = DetokParams(stop=[stop])
    deltas = stream(
        IncrementalDetokenizer(tokenizer),
        one_at_a_time(ids[:upto]),
        params,
        FinishReason(kind="stop", matched=stop),
    )
    assert "".join(deltas) == "Hello world. The "
    # A tail that looks like the stop's start is held, then released when it is not.
    deltas = stream(
        IncrementalDetokenizer(tokenizer), one_at_a_time(ids), DetokParams(stop=["end of"])
    )
    held = next(k for k, i in enumerate(ids) if tokenizer.decode([i]) == " end")
    assert "end" not in deltas[held] and deltas[held + 1] == "end is"
    assert "".join(deltas) == text


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Any) -> None:
    ids = tokenizer.encode("The end is near")
    stop = "end is"
    upto = next(n for n in range(len(ids)) if stop in tokenizer.decode(ids[: n + 1])) + 1
    deltas = stream(
        IncrementalDetokenizer(tokenizer),
        one_at_a_time(ids[:upto]),
        DetokParams(stop=[stop], no_stop_trim=True),
        FinishReason(kind="stop", matched=stop),
    )
    assert "".join(deltas) == "The end is"


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_matched_stop_token_leaves_the_text(tokenizer: Any, no_stop_trim: bool) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("Hi there"), eos]
    deltas = stream(
        IncrementalDetokenizer(tokenizer),
        one_at_a_time(ids),
        DetokParams(
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            no_stop_trim=no_stop_trim,
        ),
        FinishReason(kind="stop", matched=eos),
    )
    assert "".join(deltas) == ("Hi there<|im_end|>" if no_stop_trim else "Hi there")


def test_deltas_carry_ids_counters_and_logprob_texts(tokenizer: Any) -> None:
    ids = tokenizer.encode("naïve 😀")
    tops = [TopLogprobs(token_ids=pack_tokens([i, 2]), logprobs=[-0.1, -3.0]) for i in ids]
    out = step_output(
        ids,
        LENGTH,
        index=1,
        prompt_tokens=7,
        completion_tokens=len(ids),
        cached_tokens=3,
        token_logprobs=[-0.5] * len(ids),
        top_logprobs=tops,
    )
    other = step_output([ids[0]], rid="r1", gateway_id="gw1")
    deltas = IncrementalDetokenizer(tokenizer).process(
        StepOutputBatch(worker_id="w0", step=0, outputs=[out, other])
    )
    assert sorted(deltas) == ["gw0", "gw1"]
    (delta,) = deltas["gw0"]
    assert isinstance(delta, TextDelta)
    assert (delta.rid, delta.index, delta.text) == ("r0", 1, "naïve 😀")
    assert delta.token_ids_list == ids and delta.finish_reason == LENGTH
    assert (delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens) == (7, len(ids), 3)
    assert delta.logprobs is not None
    assert [e.token for e in delta.logprobs] == [tokenizer.decode([i]) for i in ids]
    assert [e.token_id for e in delta.logprobs] == ids
    assert all(e.logprob == -0.5 for e in delta.logprobs)
    assert [t.token for t in delta.logprobs[0].top] == [tokenizer.decode([ids[0]]), "<|im_end|>"]
    assert deltas["gw1"][0].logprobs is None


def test_choices_and_repeats_in_one_batch_keep_their_own_state(tokenizer: Any) -> None:
    a, b = tokenizer.encode("one two"), tokenizer.encode("你好")
    detok = IncrementalDetokenizer(tokenizer)
    outputs = [
        step_output(a[:1], index=0),
        step_output(b[:1], index=1),
        step_output(a[1:], LENGTH, index=0, sent_before=1),  # one stream twice in a batch
        step_output(b[1:], LENGTH, index=1, sent_before=1),
    ]
    deltas = detok.process(StepOutputBatch(worker_id="w0", step=0, outputs=outputs))["gw0"]
    assert [d.index for d in deltas] == [0, 1, 0, 1]
    assert "".join(d.text for d in deltas if d.index == 0) == "one two"
    assert "".join(d.text for d in deltas if d.index == 1) == "你好"
    assert len(detok) == 0


def test_the_lru_bound_evicts_the_oldest_unfinished_stream(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, max_requests=2)
    for rid in ("a", "b", "c"):
        detok.process(StepOutputBatch(worker_id="w0", step=0, outputs=[step_output([5], rid=rid)]))
    assert len(detok) == 2 and detok.evicted == 1
    assert detok.status("a") is None and detok.status("b") is not None
    last = step_output([6], LENGTH, "c", sent_before=1)
    detok.process(StepOutputBatch(worker_id="w0", step=1, outputs=[last]))
    assert len(detok) == 1 and detok.status("c") is None
    with pytest.raises(ValueError, match="max_requests"):
        IncrementalDetokenizer(tokenizer, max_requests=0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_with_lost_tokens_waits_for_its_history_then_fails_without_one(
    tokenizer: Any,
) -> None:
    clock = Clock()
    detok = IncrementalDetokenizer(tokenizer, resync_timeout_s=5, clock=clock)
    a, b = tokenizer.encode("one two three four"), tokenizer.encode("five six")

    def step(n: int, *outputs: StepOutput) -> list[TextDelta]:
        batch = StepOutputBatch(worker_id="w0", step=n, outputs=list(outputs))
        return detok.process(batch).get("gw0", [])

    assert len(step(0, step_output(a[:1], rid="r0"), step_output(b[:1], rid="r1"))) == 2
    assert len(step(1, step_output(a[1:2], rid="r0", sent_before=1))) == 1
    assert detok.take_lost() == [] and detok.take_resyncs() == []
    # r0's step with a[2:3] never arrives; its next output says 3 tokens came before.
    deltas = step(2, step_output(a[3:], rid="r0", sent_before=3), step_output(b[1:], rid="r1"))
    # r1's second output claims no earlier tokens, though one arrived: asked for as well.
    assert deltas == []
    assert detok.take_resyncs() == ["r0", "r1"] and detok.take_resyncs() == []
    assert detok.take_lost() == [] and len(detok) == 0
    # Later outputs are dropped (every choice) while the history is due; none comes.
    assert step(3, step_output([], LENGTH, rid="r0", sent_before=4)) == []
    clock.now = 4.9
    detok.expire()
    assert detok.take_lost() == []
    clock.now = 5.0
    detok.expire()
    assert [(x.rid, x.gateway_id) for x in detok.take_lost()] == [("r0", "gw0"), ("r1", "gw0")]
    # A failed request stays failed, even if its history comes late.
    late = step_output(a, LENGTH, rid="r0", detok=DetokParams())
    assert detok.process(StepOutputBatch(worker_id="w0", step=4, resent=[late])) == {}
    assert detok.take_lost() == [] and detok.take_resyncs() == []


def test_a_lost_step_of_one_choice_stops_every_choice_until_the_history(tokenizer: Any) -> None:
    # n = 2: choice 1's second step is lost, choice 0's arrives in the same round as
    # choice 1's third. Choice 0 sends no delta and keeps no state: the history
    # rebuilds both.
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("one two three")

    def step(n: int, *outputs: StepOutput) -> list[TextDelta]:
        batch = StepOutputBatch(worker_id="w0", step=n, outputs=list(outputs))
        return detok.process(batch).get("gw0", [])

    assert len(step(0, step_output(ids[:1], index=0), step_output(ids[:1], index=1))) == 2
    late = step_output(ids[2:3], index=1, sent_before=2)  # its step 1 never came
    assert step(2, step_output(ids[1:2], index=0, sent_before=1), late) == []
    assert detok.take_resyncs() == ["r0"]
    assert len(detok) == 0 and detok.take_lost() == []


def test_a_new_detokenizer_asks_for_streams_that_began_before_it(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer)
    mid = step_output(ids[2:], LENGTH, sent_before=2)  # the first two went to another one
    assert detok.process(StepOutputBatch(worker_id="w0", step=9, outputs=[mid])) == {}
    assert detok.take_resyncs() == ["r0"] and detok.take_lost() == []
    # An evicted stream (over max_requests) is asked for the same way, not restarted.
    small = IncrementalDetokenizer(tokenizer, max_requests=1)
    for rid in ("a", "b"):
        small.process(StepOutputBatch(worker_id="w0", step=0, outputs=[step_output([5], rid=rid)]))
    later = step_output([6], LENGTH, "a", sent_before=1)
    assert small.process(StepOutputBatch(worker_id="w0", step=1, outputs=[later])) == {}
    assert small.take_resyncs() == ["a"]


def test_ids_outside_the_vocabulary_are_ignored(tokenizer: Any) -> None:
    ids = tokenizer.encode("fine")
    out = step_output([-1, *ids, 10**9], LENGTH)
    (delta,) = IncrementalDetokenizer(tokenizer).process(
        StepOutputBatch(worker_id="w0", step=0, outputs=[out])
    )["gw0"]
    assert delta.text == "fine"


def test_engine_streaming_uses_the_same_decoding(tokenizer: Any) -> None:
    from radixserve.engine.outputs import Tracked, final_output, stream_delta
    from radixserve.engine.request import FinishReason as EngineFinish
    from radixserve.engine.request import Req
    from radixserve.engine.sampling.params import SamplingParams

    ids = tokenizer.encode(TEXTS[0])
    stop = "ok 🎉"
    upto = next(n for n in range(len(ids)) if stop in tokenizer.decode(ids[: n + 1])) + 1
    params = SamplingParams.from_dict({"stop": [stop], "skip_special_tokens": False})
    req = Req(rid="r", origin_input_ids=[1], params=params, seed=0, stop_token_ids=frozenset())
    tracked = Tracked(req)
    deltas = []
    for k in range(upto):
        req.output_ids.append(ids[k])
        if k == upto - 1:
            req.finish_reason = EngineFinish("stop", matched=stop)
        delta = stream_delta(tracked, tokenizer)
        assert delta is not None and delta["output_ids"] == [ids[k]]
        deltas.append(delta["text"])
    assert stream_delta(tracked, tokenizer) is not None  # finished: a final, empty delta
    expected = tokenizer.decode(ids[:upto], skip_special_tokens=False)
    expected = expected[: expected.find(stop)]
    assert "".join(deltas) == expected and not any(REPLACEMENT_CHAR in d for d in deltas)
    assert final_output(Tracked(req), tokenizer)["text"] == expected


def test_decode_step_by_hand(tokenizer: Any) -> None:
    ids = tokenizer.encode("a 😀")
    status = DecodeStatus(DetokParams())
    parts = [decode_step(tokenizer, status, [i], None) for i in ids]
    assert parts[-1].endswith("😀") and "".join(parts) == "a 😀"
    assert decode_step(tokenizer, status, [], LENGTH) == "" and status.finished
    assert decode_step(tokenizer, status, ids, LENGTH) == "", "nothing after the finish"


def test_stop_prefix_len_and_trim() -> None:
    assert stop_prefix_len("abc", ["cd"]) == 1
    assert stop_prefix_len("abcd", ["cd", "bcx"]) == 2
    assert stop_prefix_len("abc", ["x", ""]) == 0
    assert stop_prefix_len("ab", ["abc"]) == 2
    stop = FinishReason(kind="stop", matched="cd")
    assert trim_stop_string("abcdef", stop, False) == "ab"
    assert trim_stop_string("abcdef", stop, True) == "abcdef"
    assert trim_stop_string("abcdef", FinishReason(kind="length"), False) == "abcdef"
    assert trim_stop_string("abcdef", FinishReason(kind="stop", matched=2), False) == "abcdef"


def test_step_gaps() -> None:
    gaps = StepGaps(max_workers=2)
    assert [gaps.observe("w0", s) for s in (0, 1, 4, 4, 0, 1)] == [0, 0, 2, 0, 0, 0]
    assert gaps.observe("w1", 9) == 0 and gaps.observe("w2", 3) == 0
    assert gaps.observe("w0", 5) == 0, "an evicted worker starts over"


def test_spaces_between_special_tokens_streams_like_the_whole(tokenizer: Any) -> None:
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    ids = [start, *tokenizer.encode("user"), end, *tokenizer.encode(" done"), start, end]
    params = DetokParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    deltas = stream(IncrementalDetokenizer(tokenizer), one_at_a_time(ids), params)
    # A space where the text has none; no doubled space where it has one.
    assert "".join(deltas) == "<|im_start|> user <|im_end|> done <|im_start|> <|im_end|>"


def test_a_choice_first_delta_names_its_worker(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hello world")
    first = step_output(ids[:1], detok=DetokParams())
    (delta,) = detok.process(StepOutputBatch(worker_id="w7", step=1, outputs=[first]))["gw0"]
    assert delta.worker_id == "w7"
    later = step_output(ids[1:], LENGTH, sent_before=1)
    (delta,) = detok.process(StepOutputBatch(worker_id="w7", step=2, outputs=[later]))["gw0"]
    assert delta.worker_id == ""


def test_a_rerouted_request_repeating_tokens_continues_without_them(tokenizer: Any) -> None:
    # The request's first worker died after 3 tokens; the scheduler had seen 2, so the
    # new worker resumes at 2 and repeats token 3 (greedy: the same one): it is cut off,
    # and the text is the uninterrupted one. Repeating a different token has it
    # asked for from the start.
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("one two three four five")

    def step(worker: str, n: int, *outputs: StepOutput) -> list[TextDelta]:
        batch = StepOutputBatch(worker_id=worker, step=n, outputs=list(outputs))
        return detok.process(batch).get("gw0", [])

    text = [d.text for d in step("w0", 0, step_output(ids[:3]))]
    resumed = step("w1", 0, step_output(ids[2:4], sent_before=2))
    assert [num_tokens(d.token_ids) for d in resumed] == [1]
    text += [d.text for d in resumed]
    text += [d.text for d in step("w1", 1, step_output(ids[4:], LENGTH, sent_before=4))]
    assert "".join(text) == tokenizer.decode(ids)
    assert detok.take_lost() == []
    other = [*ids[:1], ids[1] + 1]
    step("w0", 2, step_output(ids[:2], rid="r1"))
    assert step("w1", 0, step_output(other, rid="r1", sent_before=0)) == []
    assert detok.take_resyncs() == ["r1"]
