"""The gateway as a subprocess on real NATS and Redis, driven by the official OpenAI client.

The test plays the rest of the request path itself, as a real peer on the bus: it
takes `SubmitRequest`s from `{p}.tokenize` (queue `tokenizer`), answers each with
`TextDeltaBatch`es (or a `RequestError`) on the gateway's own subjects, listens on
`{p}.abort` as the scheduler would, answers `{p}.flush_cache`, and publishes a worker
`Heartbeat` and `WorkerStats`. What it sends is chosen by the prompt:

- `error:<status>:<code>` -> a `RequestError` (429/503 with `retry_after_s` 1.5);
- `hang` -> nothing; `endless` -> one delta and nothing more;
- `slow` -> the normal answer after 1 s; `abort` -> a choice finished with kind abort;
- anything else -> per choice the tokens `Re`, `:`, ` <first word>`, ` #<choice>`,
  cut (finish `length`) at `max_new_tokens`, else finish `stop`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.gateway import (
    CACHED_TOKENS,
    MODEL,
    REQUEST_TIMEOUT_S,
    RESUME_GRACE_S,
    WAIT_S,
    FakePipeline,
    Gateway,
    expected_text,
)

pytestmark = pytest.mark.timeout(60)


async def test_models_health_and_request_ids(
    pipeline: FakePipeline, http: httpx.AsyncClient, client: openai.AsyncOpenAI
) -> None:
    # Up but not ready: live, and 503 with what is missing on readiness and the models.
    assert (await http.get("/health/live")).json() == {"status": "alive"}
    ready = await http.get("/health/ready")
    assert ready.status_code == 503
    assert ready.json()["missing"] == ["tokenizer", "scheduler", "grammar", "detokenizer", "worker"]
    with pytest.raises(openai.APIStatusError) as refused:
        await client.with_options(max_retries=0).models.list()
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "not_ready"  # type: ignore[index]
    assert (await http.get(f"/v1/models/{MODEL}")).status_code == 503

    await pipeline.heartbeat()  # a worker and a tokenizer
    missing = ["scheduler", "grammar", "detokenizer"]
    body = await _health_once(http, lambda body: body["missing"] == missing)
    assert body["status"] == "not_ready" and body["workers_ready"] == 1
    for service in missing:
        await pipeline.alive(service)
    body = await _health_once(http, lambda body: body["status"] == "ok")
    # Services by their heartbeats: the gateway hears its own; nothing else runs here.
    assert body["services"] == {
        "gateway": 1,
        "tokenizer": 1,
        "scheduler": 1,
        "worker": 0,
        "grammar": 1,
        "detokenizer": 1,
    }
    assert body["missing"] == []
    assert (await http.get("/health/ready")).json() == {"status": "ready"}
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = await http.get("/health")
    assert health.status_code == 200
    assert len(health.headers["x-request-id"]) == 32


async def _health_once(
    http: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The first /health body for which `done` holds (its status 503 until it is ready)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        health = await http.get("/health")
        body: dict[str, Any] = health.json()
        assert health.status_code == (200 if body["status"] == "ok" else 503), body
        if done(body):
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.05)


async def test_chat_completion_non_streaming_maps_fields(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
        ],
        n=2,
        temperature=0.3,
        stop="\n\n",
        logprobs=True,
        top_logprobs=2,
        seed=7,
        extra_body={"top_k": 5, "min_p": 0.1, "unknown_field": [1]},
    )  # fmt: skip
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == MODEL
    assert [c.index for c in completion.choices] == [0, 1]
    for c in completion.choices:
        assert c.message.role == "assistant"
        assert c.message.content == expected_text("hello", c.index)
        assert c.finish_reason == "stop"
        assert c.logprobs is not None and c.logprobs.content is not None
        tokens = [entry.token for entry in c.logprobs.content]
        assert "".join(tokens) == c.message.content
        first = c.logprobs.content[0]
        assert first.logprob == -0.5 and first.bytes == list(b"Re")
        assert [t.token for t in first.top_logprobs] == ["Re", "x"]
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 8, 18)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS

    submit = await pipeline.next_submit()
    assert submit.rid == completion.id
    assert submit.model == MODEL
    assert submit.messages is not None
    assert [(m.role, m.content) for m in submit.messages] == [
        ("system", "be brief"),
        ("user", "hello\nthere"),
    ]
    s = submit.sampling
    assert (s.n, s.temperature, s.stop, s.seed, s.top_k, s.min_p) == (2, 0.3, ["\n\n"], 7, 5, 0.1)
    assert (s.max_new_tokens, s.return_logprob, s.top_logprobs_num) == (256, True, 2)


async def test_chat_streaming_with_usage(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=3,
    )
    chunks = [chunk async for chunk in stream]
    ids = {chunk.id for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("stream", 0, tokens=3)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (10, 3)
    assert (await pipeline.next_submit()).sampling.max_new_tokens == 3


async def test_completions_prompt_list_echo_and_legacy_logprobs(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    result = await client.completions.create(
        model=MODEL, prompt=["alpha beta", "gamma"], n=2, echo=True, logprobs=1
    )
    assert result.id.startswith("cmpl-")
    labels = ["alpha", "gamma"]
    prompts = ["alpha beta", "gamma"]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for c in result.choices:
        prompt_index, choice = divmod(c.index, 2)
        completion_text = expected_text(labels[prompt_index], choice)
        assert c.text == prompts[prompt_index] + completion_text
        assert c.finish_reason == "stop"
        lp = c.logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        assert "".join(lp.tokens) == completion_text
        assert lp.token_logprobs == [-0.5] * 4
        assert lp.top_logprobs is not None and lp.top_logprobs[0] == {"Re": -0.5}
        # Offsets index into the choice's text, which starts with the echoed prompt.
        for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
            assert c.text[offset : offset + len(token)] == token
    assert result.usage is not None
    assert result.usage.prompt_tokens == 5 + 4  # once per prompt, not per choice
    assert result.usage.completion_tokens == 16
    submits = sorted([await pipeline.next_submit() for _ in range(2)], key=lambda s: s.rid)
    assert [s.rid for s in submits] == [f"{result.id}-0", f"{result.id}-1"]
    assert {s.text for s in submits} == set(prompts)
    assert all(s.sampling.max_new_tokens == 16 for s in submits)  # the legacy default


async def test_completions_streaming_token_ids(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt=[[1, 2, 3], [4, 5]], stream=True, max_tokens=2
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: "Re:", 1: "Re:"}
    assert finish == {0: "length", 1: "length"}
    submits = [await pipeline.next_submit() for _ in range(2)]
    assert sorted(s.input_ids_list or [] for s in submits) == [[1, 2, 3], [4, 5]]


# -- native /generate -------------------------------------------------------------------------


async def test_generate_non_streaming_and_streaming(
    pipeline: FakePipeline, http: httpx.AsyncClient
) -> None:
    body = {"text": "native call", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["text"] == expected_text("native", 0)
    assert out["output_ids"] == [100, 101, 102, 103]
    meta = out["meta_info"]
    assert meta["id"] == response.headers["x-request-id"]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 4, 2)
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["e2e_latency"] > 0
    submit = await pipeline.next_submit()
    assert (submit.text, submit.sampling.max_new_tokens, submit.sampling.temperature) == (
        "native call",
        8,
        0.0,
    )

    events: list[Any] = []
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    texts = [p["text"] for p in payloads]
    assert texts == [expected_text("native", 0, k) for k in range(1, 5)]  # cumulative
    assert payloads[-1]["output_ids"] == [100, 101, 102, 103]
    assert payloads[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(p["meta_info"]["finish_reason"] is None for p in payloads[:-1])


async def test_generate_abort_finish_and_bad_sampling_params(
    pipeline: FakePipeline, http: httpx.AsyncClient
) -> None:
    response = await http.post("/generate", json={"text": "abort", "sampling_params": {}})
    assert response.json()["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "fake abort",
    }
    bad = await http.post("/generate", json={"text": "x", "sampling_params": {"max_tokens": 3}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "sampling_params.max_tokens"
    both = await http.post("/generate", json={"text": "x", "input_ids": [1]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "text"


# -- errors ---------------------------------------------------------------------------------


async def test_invalid_parameters_are_400_with_param(
    pipeline: FakePipeline, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert info.value.status_code == 400
    assert info.value.param == "temperature"
    assert info.value.code == "invalid_request_error"

    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt=[1, 2], echo=True)
    assert info.value.param == "echo"

    image: Any = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.param == "messages[0].content[0].type"

    malformed = await http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    error = malformed.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert malformed.headers["x-request-id"].startswith("chatcmpl-")

    wrong_type = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": "5"})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"

    unknown_route = await http.get("/v1/nothing")
    assert unknown_route.status_code == 404 and "error" in unknown_route.json()
    assert pipeline.submits.empty()  # none of these reached the bus


async def test_a_prompt_larger_than_the_bus_carries_is_413(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    # NATS's default max_payload is 1 MiB: a 1.2 MB prompt cannot reach the tokenizer,
    # and retrying cannot help (not a 503 "cannot reach the tokenizer").
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(model=MODEL, prompt="word " * 240_000, max_tokens=1)
    assert info.value.status_code == 413
    body: Any = info.value.body
    assert body["code"] == "request_too_large" and body["type"] == "invalid_request_error"
    assert "message bus" in body["message"]
    assert "retry-after" not in info.value.response.headers
    assert pipeline.submits.empty()


async def test_a_body_far_past_the_bus_limit_is_413_before_it_is_parsed(
    pipeline: FakePipeline, http: httpx.AsyncClient
) -> None:
    # 4 x the 1 MiB max_payload: refused by its Content-Length, and while it streams in
    # (chunked, no length); not parsed (it is not even JSON).
    body = b"x" * (4 * 1024 * 1024 + 1)
    declared = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )

    async def chunks() -> Any:
        for _ in range(5):
            yield b"x" * (1024 * 1024)

    streamed = await http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"
    assert pipeline.submits.empty()


async def test_unknown_model_is_404(pipeline: FakePipeline, client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


async def test_bus_errors_keep_status_code_param_and_retry_after(
    pipeline: FakePipeline, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "error:429:queue_full"}]
        )
    assert limited.value.code == "queue_full"
    assert limited.value.response.headers["retry-after"] == "2"  # 1.5 s rounded up

    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "error:400:context_length_exceeded"}]
        )
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.param == "messages"

    # A stream that fails before its first token still gets the real status.
    streamed = await http.post(
        "/v1/completions", json={"prompt": "error:503:no_worker", "stream": True}
    )
    assert streamed.status_code == 503
    assert streamed.headers["retry-after"] == "2"
    assert streamed.json()["error"]["code"] == "no_worker"

    # One prompt of a list fails: the answer is its error, and only the other is aborted
    # (the failed one is already gone from the pipeline).
    with pytest.raises(openai.RateLimitError) as partial:
        await client.completions.create(model=MODEL, prompt=["error:429:queue_full", "hang"])
    rid = partial.value.response.headers["x-request-id"]
    abort = await asyncio.wait_for(pipeline.aborts.get(), 2.0)
    assert abort.rid == f"{rid}-1"
    await asyncio.sleep(0.2)
    assert pipeline.aborts.empty()


async def test_openai_endpoints_turn_an_abort_finish_into_an_error(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model=MODEL, prompt="abort")
    assert info.value.code == "request_aborted"


async def test_deadline_is_504_and_aborts(
    pipeline: FakePipeline, client: openai.AsyncOpenAI
) -> None:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(model=MODEL, prompt="hang")
    assert info.value.status_code == 504
    assert info.value.code == "timeout"
    assert REQUEST_TIMEOUT_S <= time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    abort = await asyncio.wait_for(pipeline.aborts.get(), 2.0)
    assert abort.rid == (await pipeline.next_submit()).rid


# -- cancellation -------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_aborts_after_the_resume_grace(
    pipeline: FakePipeline, http: httpx.AsyncClient
) -> None:
    # A stream is resumable: its request runs on for RESUME_GRACE_S for its client to come
    # back, and is aborted once no one did.
    body = {"messages": [{"role": "user", "content": "endless"}], "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        rid = stream.headers["x-request-id"]
        lines = stream.aiter_lines()
        # The first delta's events (the role, then the text), the last named for a resume.
        assert (await anext(lines)).startswith("data: ")
        assert await anext(lines) == ""
        assert await anext(lines) == f"id: {rid}/1"
        assert (await anext(lines)).startswith("data: ")
        closed_at = time.monotonic()
    abort = await asyncio.wait_for(pipeline.aborts.get(), RESUME_GRACE_S + 2.0)
    assert time.monotonic() - closed_at >= RESUME_GRACE_S * 0.9
    assert (abort.rid, abort.reason) == (rid, "client_disconnected")


async def test_client_disconnect_while_waiting_aborts(
    pipeline: FakePipeline, gateway: Gateway
) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post("/v1/completions", json={"prompt": "hang"})
    gave_up_at = time.monotonic()
    abort = await asyncio.wait_for(pipeline.aborts.get(), 1.0)
    assert time.monotonic() - gave_up_at < 1.0
    assert abort.reason == "client_disconnected"
    assert abort.rid == (await pipeline.next_submit()).rid


# -- record, metrics, flush --------------------------------------------------------------------


async def test_request_record_in_redis(
    pipeline: FakePipeline, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    result = await client.completions.create(model=MODEL, prompt="record me", max_tokens=3)
    deadline = time.monotonic() + WAIT_S
    while True:
        response = await http.get(f"/v1/requests/{result.id}")
        if response.status_code == 200 and response.json().get("state") == "finished":
            break
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.05)
    record = response.json()
    assert record["id"] == result.id
    assert (record["endpoint"], record["model"], record["stream"]) == ("completion", MODEL, False)
    assert (record["prompt_tokens"], record["completion_tokens"], record["cached_tokens"]) == (
        5,
        3,
        2,
    )
    assert record["finish_reason"] == "length"
    assert record["received_at"] <= record["first_token_at"] <= record["finished_at"]
    missing = await http.get("/v1/requests/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # Not an id at all (a NUL, a newline, too long): a 400 at once, the connection intact.
    for bad in ("%00", "a%0Ab", "x" * 200, "%20lead"):
        refused = await http.get(f"/v1/requests/{bad}")
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["param"] == "id"


async def test_metrics_and_flush_cache(
    pipeline: FakePipeline, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    await pipeline.heartbeat("w-metrics")
    await client.completions.create(model=MODEL, prompt="count me")
    deadline = time.monotonic() + WAIT_S
    while True:
        text = (await http.get("/metrics")).text
        if 'radixserve:num_running_reqs{worker="w-metrics"} 3.0' in text:
            break
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.05)
    assert 'radixserve:num_queue_reqs{worker="w-metrics"} 1.0' in text
    for name in (
        'radixserve:requests_total{status="200"}',
        "radixserve:prompt_tokens_total",
        "radixserve:generation_tokens_total",
        "radixserve:time_to_first_token_seconds_bucket",
        "radixserve:e2e_request_latency_seconds_bucket",
        "radixserve:store_write_failures_total",
    ):
        assert name in text, name

    flushed = await http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["ok"] is True
