"""TextDeltas -> answers: merging choices, usage, logprob shapes, SSE chunks, error bodies."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from radixserve.api import (
    SSE_DONE,
    ApiError,
    Assembly,
    CompletionRequest,
    GenerateRequest,
    GenerationPlan,
    chat_completion,
    completion,
    generate_result,
    make_streamer,
    parse_body,
    plan_chat,
    plan_completion,
    plan_generate,
)
from radixserve.api.errors import error_body, param_from_loc, retry_after_header
from radixserve.api.openai_models import ChatCompletionRequest
from radixserve.api.responses import abort_error
from radixserve.protocol import (
    FinishReason,
    LogprobEntry,
    RequestError,
    TextDelta,
    TopLogprobEntry,
    pack_tokens,
)
from tests.unit.chat_answers import sse_payloads

STOP = FinishReason(kind="stop", matched="\n")
LENGTH = FinishReason(kind="length")


def _plan(endpoint: str, body: dict[str, Any]) -> GenerationPlan:
    raw = json.dumps(body).encode()
    common: dict[str, Any] = {
        "response_id": "id-1",
        "gateway_id": "gw",
        "served_model": "m",
        "arrival_time": 0.0,
    }
    if endpoint == "chat":
        return plan_chat(parse_body(ChatCompletionRequest, raw), **common)
    if endpoint == "completion":
        return plan_completion(parse_body(CompletionRequest, raw), **common)
    return plan_generate(parse_body(GenerateRequest, raw), **common)


def _entry(token: str, logprob: float, token_id: int = 1, top: int = 0) -> LogprobEntry:
    tops = [TopLogprobEntry(token_id=token_id, token=token, logprob=logprob)]
    tops += [TopLogprobEntry(token_id=9, token="?", logprob=-float("inf"))]
    return LogprobEntry(token_id=token_id, token=token, logprob=logprob, top=tops[:top])


def _delta(
    rid: str,
    text: str,
    *,
    index: int = 0,
    ids: list[int] | None = None,
    finish: FinishReason | None = None,
    prompt: int = 4,
    completion: int = 1,
    cached: int = 0,
    logprobs: list[LogprobEntry] | None = None,
) -> TextDelta:
    return TextDelta(
        rid=rid,
        text=text,
        token_ids=pack_tokens(ids if ids is not None else [len(text)]),
        index=index,
        finish_reason=finish,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        logprobs=logprobs,
    )


# -- assembly ---------------------------------------------------------------------------------


def test_assembly_merges_prompts_and_choices() -> None:
    plan = _plan("completion", {"prompt": ["a", "b"], "n": 2})
    assembly = Assembly(plan)
    assert plan.rids == ("id-1-0", "id-1-1")
    # Interleaved, as deltas of several requests arrive.
    assert assembly.apply(_delta("id-1-1", "B1", index=1, prompt=7, completion=1)) is not None
    assert assembly.apply(_delta("id-1-0", "A0", index=0, prompt=5, completion=1, cached=3))
    assert assembly.apply(_delta("id-1-0", "A1", index=1, prompt=5, completion=2, finish=STOP))
    assert not assembly.done
    assert sorted(assembly.unfinished_rids()) == ["id-1-0", "id-1-1"]
    assembly.apply(_delta("id-1-0", "+", index=0, prompt=5, completion=2, finish=LENGTH))
    assembly.apply(_delta("id-1-1", "B0", index=0, prompt=7, completion=3, finish=STOP))
    assert assembly.unfinished_rids() == ["id-1-1"]
    assembly.apply(_delta("id-1-1", "+", index=1, prompt=7, completion=2, finish=STOP))
    assert assembly.done
    assert [(c.index, c.text) for c in assembly.choices] == [
        (0, "A0+"),
        (1, "A1"),
        (2, "B0"),
        (3, "B1+"),
    ]
    usage = assembly.usage()
    # Prompt tokens once per prompt, completion tokens of every choice (latest totals).
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (12, 9, 3)
    assert usage.total_tokens == 21


def test_assembly_ignores_foreign_out_of_range_and_late_deltas() -> None:
    assembly = Assembly(_plan("chat", {"messages": [{"role": "user", "content": "x"}]}))
    assert assembly.apply(_delta("someone-else", "x")) is None
    assert assembly.apply(_delta("id-1", "x", index=1)) is None  # n == 1
    assert assembly.apply(_delta("id-1", "ok", ids=[5, 6], completion=2, finish=STOP))
    assert assembly.apply(_delta("id-1", "again", completion=9, finish=STOP)) is None
    choice = assembly.choices[0]
    assert (choice.text, choice.token_ids, choice.completion_tokens) == ("ok", [5, 6], 2)


def test_counters_are_totals_so_far_not_increments() -> None:
    assembly = Assembly(_plan("generate", {"text": "x"}))
    assembly.apply(_delta("id-1", "a", completion=3, prompt=4))
    assembly.apply(_delta("id-1", "b", completion=2, prompt=4))  # reordered: older total
    assembly.apply(_delta("id-1", "", completion=4, prompt=4, finish=STOP))
    assert assembly.usage().completion_tokens == 4


# -- non-streamed bodies -------------------------------------------------------------------------


def test_chat_completion_body_with_logprobs() -> None:
    plan = _plan(
        "chat",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
    )
    assembly = Assembly(plan)
    entries = [_entry("Hé", -0.25, 11, top=2), _entry("!", -float("inf"), 12, top=1)]
    assembly.apply(
        _delta("id-1", "Hé!", ids=[11, 12], completion=2, cached=3, logprobs=entries, finish=STOP)
    )
    body = chat_completion(plan, assembly, created=1700)
    assert body["id"] == "id-1" and body["object"] == "chat.completion"
    assert (body["created"], body["model"]) == (1700, "m")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hé!"}
    assert choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert content[0] == {
        "token": "Hé",
        "logprob": -0.25,
        "bytes": list("Hé".encode()),
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.25, "bytes": list("Hé".encode())},
            {"token": "?", "logprob": -9999.0, "bytes": [63]},
        ],
    }
    assert content[1]["logprob"] == -9999.0  # JSON has no -inf
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    json.dumps(body, allow_nan=False)  # strictly valid JSON


def test_chat_body_without_logprobs_has_null_and_length_finish() -> None:
    plan = _plan("chat", {"messages": [{"role": "user", "content": "x"}]})
    assembly = Assembly(plan)
    assembly.apply(_delta("id-1", "cut", finish=LENGTH))
    choice = chat_completion(plan, assembly, 0)["choices"][0]
    assert (choice["logprobs"], choice["finish_reason"]) == (None, "length")


def test_completion_body_echo_and_legacy_logprobs() -> None:
    plan = _plan("completion", {"prompt": "Say", "echo": True, "logprobs": 1})
    assembly = Assembly(plan)
    entries = [_entry(" hi", -0.5, 1, top=1), _entry(" there", -1.0, 2, top=1)]
    assembly.apply(_delta("id-1", " hi there", ids=[1, 2], logprobs=entries, finish=STOP))
    body = completion(plan, assembly, created=5)
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"] == "Say hi there"
    assert choice["logprobs"] == {
        "tokens": [" hi", " there"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{" hi": -0.5}, {" there": -1.0}],
        "text_offset": [3, 6],  # after the echoed prompt
    }
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_generate_single_and_batch() -> None:
    plan = _plan("generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 1})
    assembly = Assembly(plan)
    entries = [_entry("a", -0.1, 5, top=1)]
    assembly.apply(_delta("id-1", "a", ids=[5], prompt=3, cached=1, logprobs=entries, finish=STOP))
    out = generate_result(plan, assembly, e2e_latency=0.25)
    assert isinstance(out, dict)
    assert (out["text"], out["output_ids"]) == ("a", [5])
    assert out["meta_info"] == {
        "id": "id-1",
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "cached_tokens": 1,
        "finish_reason": {"type": "stop", "matched": "\n"},
        "e2e_latency": 0.25,
        "output_token_logprobs": [[-0.1, 5, "a"]],
        "output_top_logprobs": [[[-0.1, 5, "a"]]],
    }

    batch_plan = _plan("generate", {"input_ids": [[1], [2]]})
    batch = Assembly(batch_plan)
    batch.apply(_delta("id-1-0", "p", finish=FinishReason(kind="abort", message="gone")))
    batch.apply(_delta("id-1-1", "q", finish=FinishReason(kind="stop", matched=2)))
    outs = generate_result(batch_plan, batch, e2e_latency=1.0)
    assert isinstance(outs, list)
    assert [o["meta_info"]["id"] for o in outs] == ["id-1-0", "id-1-1"]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [
        {"type": "abort", "message": "gone"},
        {"type": "stop", "matched": 2},
    ]
    assert "output_token_logprobs" not in outs[0]["meta_info"]


def test_abort_error_is_a_server_error() -> None:
    plan = _plan("chat", {"messages": [{"role": "user", "content": "x"}]})
    assembly = Assembly(plan)
    assembly.apply(_delta("id-1", "", finish=FinishReason(kind="abort", message="oom")))
    aborted = assembly.aborted()
    assert aborted is not None
    err = abort_error(aborted)
    assert (err.status, err.code, err.type) == (500, "request_aborted", "server_error")
    assert "oom" in err.message


# -- streams ---------------------------------------------------------------------------------


def test_chat_stream_chunks_and_usage() -> None:
    plan = _plan(
        "chat",
        {
            "messages": [{"role": "user", "content": "x"}],
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=9)
    chunks: list[bytes] = []
    for delta in [
        _delta("id-1", "He", index=0, completion=1),
        _delta("id-1", "Yo", index=1, completion=1),
        _delta("id-1", "", index=0, completion=2),  # text held back: nothing to send
        _delta("id-1", "llo", index=0, completion=3, finish=STOP),
        _delta("id-1", "", index=1, completion=2, finish=LENGTH),
    ]:
        update = assembly.apply(delta)
        assert update is not None
        chunks += streamer.events(update, 0.0)
    chunks += streamer.final(assembly)
    events = sse_payloads(chunks)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "id-1" for e in events)
    assert all(e["usage"] is None for e in events[:-1])
    per_choice: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for e in events[:-1]:
        (choice,) = e["choices"]
        per_choice[choice["index"]].append(choice)
    for index, text, reason in [(0, "Hello", "stop"), (1, "Yo", "length")]:
        choices = per_choice[index]
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == text
        assert [c["finish_reason"] for c in choices][-1] == reason
        assert choices[-1]["delta"] == {}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5


def test_chat_stream_without_include_usage_has_no_usage_key() -> None:
    plan = _plan("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True})
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=0)
    update = assembly.apply(_delta("id-1", "a", finish=STOP))
    assert update is not None
    chunks = sse_payloads(streamer.events(update, 0.0) + streamer.final(assembly))
    assert chunks and all("usage" not in c for c in chunks)


def test_completion_stream_echo_and_running_offsets() -> None:
    plan = _plan(
        "completion", {"prompt": "Q:", "stream": True, "echo": True, "logprobs": 0, "n": 1}
    )
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=0)
    texts, offsets, tokens = [], [], []
    for delta in [
        _delta("id-1", " a", logprobs=[_entry(" a", -1.0)]),
        _delta("id-1", "bc", logprobs=[_entry("b", -1.0), _entry("c", -2.0)], completion=3),
        _delta("id-1", "", completion=3, finish=STOP),
    ]:
        update = assembly.apply(delta)
        assert update is not None
        for chunk in sse_payloads(streamer.events(update, 0.0)):
            (choice,) = chunk["choices"]
            texts.append(choice["text"])
            offsets += choice["logprobs"]["text_offset"]
            tokens += choice["logprobs"]["tokens"]
            last_reason = choice["finish_reason"]
    full = "".join(texts)
    assert full == "Q: abc"
    assert texts[0] == "Q: a"  # the prompt leads the first chunk
    assert offsets == [2, 4, 5]
    assert [full[o : o + len(t)] for o, t in zip(offsets, tokens, strict=True)] == tokens
    assert last_reason == "stop"


def test_generate_stream_is_cumulative() -> None:
    plan = _plan("generate", {"text": "x", "stream": True})
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created=0)
    events: list[dict[str, Any]] = []
    for delta in [
        _delta("id-1", "a", ids=[1]),
        _delta("id-1", "", ids=[]),  # nothing new: no event
        _delta("id-1", "b", ids=[2], completion=2, finish=STOP),
    ]:
        update = assembly.apply(delta)
        assert update is not None
        events += sse_payloads(streamer.events(update, 0.5))
    assert [e["text"] for e in events] == ["a", "ab"]
    assert [e["output_ids"] for e in events] == [[1], [1, 2]]
    assert events[0]["meta_info"]["finish_reason"] is None
    assert events[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert "index" not in events[0]
    assert streamer.final(assembly) == []
    assert SSE_DONE == b"data: [DONE]\n\n"


# -- errors ------------------------------------------------------------------------------------


def test_error_body_shape() -> None:
    assert error_body("bad", "invalid_request_error", "n", "invalid_request_error") == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_request_error",
        }
    }


@pytest.mark.parametrize(
    ("retry_after_s", "header"), [(None, None), (0.0, "1"), (1.0, "1"), (1.5, "2"), (29.01, "30")]
)
def test_request_error_keeps_status_code_param_and_retry_after(
    retry_after_s: float | None, header: str | None
) -> None:
    err = ApiError.from_request_error(
        RequestError(
            rid="r",
            code="queue_full",
            message="busy",
            http_status=429,
            error_type="rate_limit_error",
            param="x",
            retry_after_s=retry_after_s,
        )
    )
    assert (err.status, err.code, err.param, err.type) == (
        429,
        "queue_full",
        "x",
        "rate_limit_error",
    )
    assert err.body()["error"]["message"] == "busy"
    assert err.headers().get("Retry-After") == header


def test_retry_after_header_edge_cases() -> None:
    assert retry_after_header(math.inf) == 1
    assert retry_after_header(0.001) == 1


def test_param_from_loc_drops_union_branch_tags() -> None:
    assert param_from_loc(("messages", 0, "content")) == "messages[0].content"
    assert param_from_loc(("prompt", "list[constrained-int]", 1)) == "prompt[1]"
    assert param_from_loc(("response_format", "ResponseFormat", "type")) == "response_format.type"


def test_timeout_and_unavailable_errors() -> None:
    timeout = ApiError.timeout(2.0)
    assert (timeout.status, timeout.code) == (504, "timeout")
    down = ApiError.unavailable("no bus", code="no_bus")
    assert (down.status, down.code, down.headers()) == (503, "no_bus", {"Retry-After": "1"})
