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
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve.bus import Bus, BusMsg
from radixserve.infra import NatsServer, free_port
from radixserve.protocol import (
    AbortRequest,
    FinishReason,
    FlushCacheReply,
    FlushCacheRequest,
    Heartbeat,
    LogprobEntry,
    RequestError,
    Subjects,
    SubmitRequest,
    TextDelta,
    TextDeltaBatch,
    TopLogprobEntry,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
    decode,
    encode,
    pack_tokens,
)
from radixserve.services.gateway.records import RecordWriter
from radixserve.store import Store, StoreSettings
from radixserve.telemetry import GatewayMetrics

pytestmark = pytest.mark.timeout(60)

MODEL = "test-model"
REQUEST_TIMEOUT_S = 2.0
CACHED_TOKENS = 2
WAIT_S = 10.0


# -- the gateway process ------------------------------------------------------------------


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    base_url: str
    prefix: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _start_gateway(
    nats_url: str, redis_url: str, log_path: Path, *extra: str
) -> Generator[Gateway, None, None]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    port = free_port()
    argv = [
        sys.executable, "-m", "radixserve.cli", "serve", "gateway",
        "--nats-url", nats_url, "--redis-url", redis_url, "--subject-prefix", prefix,
        "--port", str(port), "--served-model-name", MODEL, *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    gateway = Gateway(proc, f"http://127.0.0.1:{port}", prefix, log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"gateway exited early:\n{gateway.log()}"
            try:
                if httpx.get(gateway.base_url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"gateway not healthy:\n{gateway.log()}"
            time.sleep(0.1)
        yield gateway
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture(scope="module")
def gateway(
    nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    yield from _start_gateway(
        nats_url, redis_url, log_path, "--request-timeout-s", str(REQUEST_TIMEOUT_S)
    )


# -- the rest of the pipeline, played over real NATS ------------------------------------------


def _label(submit: SubmitRequest) -> str:
    if submit.text is not None:
        text = submit.text
    elif submit.messages:
        text = submit.messages[-1].content
    else:
        return f"ids{len(submit.input_ids_list or [])}"
    return text.split()[0] if text.split() else "empty"


def reply_tokens(label: str, choice: int) -> list[str]:
    return ["Re", ":", f" {label}", f" #{choice}"]


def prompt_tokens_of(submit: SubmitRequest) -> int:
    if submit.input_ids is not None:
        return len(submit.input_ids_list or [])
    if submit.text is not None:
        return 3 + len(submit.text.split())
    return 10


@dataclass
class FakePipeline:
    bus: Bus
    subjects: Subjects
    submits: asyncio.Queue[SubmitRequest] = field(default_factory=asyncio.Queue)
    aborts: asyncio.Queue[AbortRequest] = field(default_factory=asyncio.Queue)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.tokenize, self._on_submit, queue="tokenizer")
        await self.bus.subscribe(self.subjects.abort, self._on_abort, queue="scheduler")
        await self.bus.subscribe(self.subjects.flush_cache, self._on_flush, queue="scheduler")

    async def _on_submit(self, msg: BusMsg) -> None:
        submit = decode(msg.data, SubmitRequest)
        self.submits.put_nowait(submit)
        task = asyncio.create_task(self._play(submit))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _on_abort(self, msg: BusMsg) -> None:
        self.aborts.put_nowait(decode(msg.data, AbortRequest))

    async def _on_flush(self, msg: BusMsg) -> None:
        request = decode(msg.data, FlushCacheRequest)
        await self.bus.respond(msg, encode(FlushCacheReply(rid=request.rid, ok=True)))

    async def _play(self, submit: SubmitRequest) -> None:
        label = _label(submit)
        deltas_subject = self.subjects.gateway_deltas(submit.gateway_id)
        if label.startswith("error:"):
            _, status, code = label.split(":")
            error = RequestError(
                rid=submit.rid,
                code=code,
                message=f"fake {code}",
                http_status=int(status),
                param="messages" if status == "400" else None,
                retry_after_s=1.5 if status in ("429", "503") else None,
                service="test",
            )
            await self.bus.publish(self.subjects.gateway_errors(submit.gateway_id), encode(error))
            return
        if label == "hang":
            return
        if label == "slow":
            await asyncio.sleep(1.0)
        sampling = submit.sampling
        tokens = reply_tokens(label, 0)
        steps = min(len(tokens), sampling.max_new_tokens)
        for step in range(steps):
            deltas = []
            for choice in range(sampling.n):
                text = reply_tokens(label, choice)[step]
                last = step == steps - 1
                finish = None
                if label == "abort" and last:
                    finish = FinishReason(kind="abort", message="fake abort")
                elif last:
                    finish = (
                        FinishReason(kind="stop", matched=2)
                        if steps == len(tokens)
                        else FinishReason(kind="length")
                    )
                logprobs = None
                if sampling.return_logprob:
                    top = [
                        TopLogprobEntry(token_id=100 + step, token=text, logprob=-0.5),
                        TopLogprobEntry(token_id=7, token="x", logprob=-3.0),
                    ][: sampling.top_logprobs_num]
                    logprobs = [
                        LogprobEntry(token_id=100 + step, token=text, logprob=-0.5, top=top)
                    ]
                deltas.append(
                    TextDelta(
                        rid=submit.rid,
                        text=text,
                        token_ids=pack_tokens([100 + step]),
                        index=choice,
                        finish_reason=finish,
                        prompt_tokens=prompt_tokens_of(submit),
                        completion_tokens=step + 1,
                        cached_tokens=CACHED_TOKENS,
                        logprobs=logprobs,
                    )
                )
            batch = TextDeltaBatch(gateway_id=submit.gateway_id, deltas=deltas)
            await self.bus.publish(deltas_subject, encode(batch))
            if label == "endless":
                return
            await asyncio.sleep(0.01)

    async def heartbeat(self, worker_id: str = "w-fake") -> None:
        beat = Heartbeat(
            worker_id=worker_id,
            time=time.time(),
            status=WorkerStatus.READY,
            capacity=WorkerCapacity(
                max_running_requests=8, max_total_num_tokens=4096, max_context_len=2048
            ),
            epoch=1,
        )
        await self.bus.publish(self.subjects.heartbeat(worker_id), encode(beat))
        stats = WorkerStats(
            worker_id=worker_id,
            time=time.time(),
            num_running_reqs=3,
            num_queue_reqs=1,
            free_kv_tokens=1000,
        )
        await self.bus.publish(self.subjects.stats(worker_id), encode(stats))

    async def next_submit(self) -> SubmitRequest:
        return await asyncio.wait_for(self.submits.get(), WAIT_S)


@pytest.fixture
async def pipeline(gateway: Gateway, nats_url: str) -> AsyncIterator[FakePipeline]:
    bus = await Bus.connect(nats_url)
    fake = FakePipeline(bus, Subjects(gateway.prefix))
    await fake.start()
    yield fake
    for task in list(fake.tasks):
        task.cancel()
    await bus.close()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    # No retries: a 429 or 503 must reach the test as it was answered.
    async with openai.AsyncOpenAI(
        base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S
    ) as oai:
        yield oai


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as c:
        yield c


def expected_text(label: str, choice: int, tokens: int = 4) -> str:
    return "".join(reply_tokens(label, choice)[:tokens])


# -- the OpenAI endpoints -------------------------------------------------------------------


async def test_models_health_and_request_ids(
    pipeline: FakePipeline, http: httpx.AsyncClient, client: openai.AsyncOpenAI
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await pipeline.heartbeat()
    deadline = time.monotonic() + WAIT_S
    while True:
        health = await http.get("/health")
        assert health.status_code == 200
        if health.json()["workers_ready"] == 1:
            break
        assert time.monotonic() < deadline, health.json()
        await asyncio.sleep(0.05)
    assert health.json()["status"] == "ok"
    assert len(health.headers["x-request-id"]) == 32


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


async def test_client_disconnect_mid_stream_aborts_within_a_second(
    pipeline: FakePipeline, http: httpx.AsyncClient
) -> None:
    body = {"messages": [{"role": "user", "content": "endless"}], "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        rid = stream.headers["x-request-id"]
        lines = stream.aiter_lines()
        first = await anext(lines)
        assert first.startswith("data: ")
        closed_at = time.monotonic()
    abort = await asyncio.wait_for(pipeline.aborts.get(), 1.0)
    assert time.monotonic() - closed_at < 1.0
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


# -- drain --------------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_requests_then_exits_with_redis_down(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Redis is down for this gateway: requests are served all the same.
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    gen = _start_gateway(nats_url, dead_redis, tmp_path / "drain.log")
    gateway = next(gen)
    bus = await Bus.connect(nats_url)
    fake = FakePipeline(bus, Subjects(gateway.prefix))
    try:
        await fake.start()
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            slow = asyncio.create_task(http.post("/v1/completions", json={"prompt": "slow"}))
            await fake.next_submit()
            # Its record write failed and was counted; reading records is a 503.
            deadline = time.monotonic() + WAIT_S
            while "radixserve:store_write_failures_total 0.0" in (await http.get("/metrics")).text:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            record = await http.get("/v1/requests/anything")
            assert record.status_code == 503
            assert record.json()["error"]["code"] == "store_unavailable"
            gateway.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + WAIT_S
            while True:  # new requests are refused while the slow one finishes
                refused = await http.post("/v1/completions", json={"prompt": "late"})
                if refused.status_code == 503:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert refused.json()["error"]["code"] == "draining"
            finished = await slow
        assert finished.status_code == 200, finished.text
        assert finished.json()["choices"][0]["text"] == expected_text("slow", 0, 4)
        code = await asyncio.to_thread(gateway.proc.wait, 15)
        assert code == 0, gateway.log()
    finally:
        await bus.close()
        gen.close()
        if os.environ.get("RADIXSERVE_TEST_SHOW_LOGS"):
            print(gateway.log())


async def test_nats_down_is_503_and_recovers(
    private_nats: NatsServer, redis_url: str, tmp_path: Path
) -> None:
    gen = _start_gateway(private_nats.url, redis_url, tmp_path / "nats_down.log")
    gateway = next(gen)
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=WAIT_S) as http:
            private_nats.kill()
            deadline = time.monotonic() + WAIT_S
            while (await http.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.05)
            refused = await http.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_bus"
            assert refused.headers["retry-after"] == "1"
            private_nats.start()
            deadline = time.monotonic() + WAIT_S
            while (await http.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, gateway.log()
                await asyncio.sleep(0.05)
    finally:
        gen.close()


# -- the record writer on its own: Redis slow or down never blocks the request path ------------


def failures(metrics: GatewayMetrics) -> float | None:
    return metrics.registry.get_sample_value("radixserve:store_write_failures_total")


async def test_record_writer_writes_in_order_and_drops_when_redis_is_down(
    redis_url: str,
) -> None:
    metrics = GatewayMetrics()
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = Store(StoreSettings(url=redis_url, key_prefix=prefix))
    writer = RecordWriter(store, ttl_s=60, metrics=metrics)
    task = asyncio.create_task(writer.run())
    try:
        writer.put("r1", {"state": "received", "n": 1})
        writer.update("r1", {"state": "finished", "prompt_tokens": 4, "finished_at": 1.5})
        writer.update("ghost", {"state": "finished"})  # no record: nothing written
        assert await writer.flush(timeout_s=5.0)
        record = await writer.get("r1")
        assert record == {
            "id": "r1",
            "state": "finished",
            "n": 1,
            "prompt_tokens": 4,
            "finished_at": 1.5,
        }
        assert await writer.get("ghost") is None
        ttl = await store.request_ttl_s("r1")
        assert ttl is not None and 0 < ttl <= 60
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.delete_request("r1")
        await store.close()
    assert failures(metrics) == 0

    dead = Store(
        StoreSettings(
            url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.2, socket_timeout_s=0.2
        )
    )
    down = RecordWriter(dead, ttl_s=60, metrics=metrics, max_pending=2, write_timeout_s=0.5)
    started = time.monotonic()
    for i in range(5):  # two queued, three dropped at once: the caller never waits
        down.put(f"r{i}", {"state": "received"})
    assert time.monotonic() - started < 0.05
    assert failures(metrics) == 3
    task = asyncio.create_task(down.run())
    try:
        assert await down.flush(timeout_s=5.0)
        await asyncio.sleep(0.6)  # let the last write time out or fail
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await dead.close()
    assert failures(metrics) == 5
