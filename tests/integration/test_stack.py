"""The whole stack, driven as users drive it: the official `openai` client and httpx.

Real NATS and Redis, the six services as processes, a tiny random-weight Llama with
the real SmolLM2 tokenizer. References: the in-process `Engine` on the same weights
(greedy token ids and text).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve import Engine, protocol
from radixserve.bus import Bus, BusMsg
from tests.helpers.tiny_models import embedded_model_dir, make_tiny_llama
from tests.integration.stack_fixture import (
    BATCH_EXACT_DTYPE,
    CPU_WORKER_ARGS,
    RunningStack,
    running_stack,
)
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(300)

CONTEXT = 100_000  # longer than the model was built for: long requests for the 504 test


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama, and (slow) the embedded SmolLM2-135M-Instruct."""
    if request.param == "smollm2":
        return embedded_model_dir()
    return make_tiny_llama(tmp_path_factory.mktemp("stack_model"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(
        model_path=str(model_dir), device="cpu", dtype=BATCH_EXACT_DTYPE, context_length=CONTEXT
    )


@pytest.fixture(scope="module")
def stack(
    nats_url: str, redis_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    with running_stack(
        nats_url,
        redis_url,
        model_dir,
        tmp_path_factory.mktemp("stack_logs"),
        CPU_WORKER_ARGS,
        extra_args={
            "gateway": ["--request-timeout-s", "20"],
            "scheduler": ["--max-pending-requests", "24"],
        },
        context_length=CONTEXT,
    ) as running:
        yield running


@pytest.fixture()
def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_models_lists_the_served_name(client: openai.OpenAI, stack: RunningStack) -> None:
    assert [m.id for m in client.models.list().data] == [stack.model]


def test_health_cli_sees_every_service(stack: RunningStack) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "health",
            "--nats-url",
            stack.nats_url,
            "--subject-prefix",
            stack.subject_prefix,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for service in ("gateway", "tokenizer", "scheduler", "worker", "grammar", "detokenizer"):
        assert f"{service:<12} ready" in proc.stdout, proc.stdout
    health = httpx.get(f"{stack.url}/health", timeout=10).json()
    assert health["workers_ready"] == 1
    assert set(health["services"].values()) == {1}, health  # one of each, all ready


def test_every_service_runs_on_uvloop(stack: RunningStack) -> None:
    """uvloop is a dependency on Linux, so `auto` gives every service its loop."""
    logs = sorted(stack.stack.spec.log_dir.glob("*.log"))
    assert len(logs) == 6, logs
    for log in logs:
        assert "on the uvloop event loop" in log.read_text(), log.name


def test_chat_equals_the_engine_streaming_or_not(
    client: openai.OpenAI, stack: RunningStack, engine: Engine
) -> None:
    messages = [{"role": "user", "content": "Tell me about radix trees."}]
    reference = engine.chat(messages, {"temperature": 0, "max_new_tokens": 12})
    reply = client.chat.completions.create(model=stack.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == reference["text"]
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens_details is not None
    assert reply.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=stack.model,
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,  # type: ignore[arg-type]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["text"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 12
    assert chunks[-1].choices == []


def test_completions_n2_logprobs_and_stop(
    client: openai.OpenAI, stack: RunningStack, engine: Engine
) -> None:
    prompt = "The radix tree keeps"
    reference = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12})
    assert isinstance(reference, dict)
    out = client.completions.create(model=stack.model, prompt=prompt, logprobs=2, **GREEDY)  # type: ignore[arg-type]
    assert out.choices[0].text == reference["text"]
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in logprobs.token_logprobs)
    two = client.completions.create(
        model=stack.model, prompt=prompt, n=2, temperature=1.0, seed=7, max_tokens=8
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    text = reference["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.completions.create(model=stack.model, prompt=prompt, stop=[stop], **GREEDY)  # type: ignore[arg-type]
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    # Streamed, the stop string never leaks either, whichever deltas it spans.
    streamed = client.completions.create(
        model=stack.model,
        prompt=prompt,
        stop=[stop],
        stream=True,
        **GREEDY,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.find(stop)]


def test_repeated_long_prefix_is_cached(client: openai.OpenAI, stack: RunningStack) -> None:
    prompt = "radix " * 300
    client.completions.create(model=stack.model, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=stack.model, prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= again.usage.prompt_tokens - 1 > 0


def test_native_generate_and_flush(stack: RunningStack, engine: Engine) -> None:
    (ids,) = make_prompts(engine.runner.vocab_size, [40], seed=3)
    reference = engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 10}
    )
    assert isinstance(reference, dict)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    out = httpx.post(f"{stack.url}/generate", json=body, timeout=60).json()
    assert out["output_ids"] == reference["output_ids"] and out["text"] == reference["text"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 40 and meta["completion_tokens"] == 10
    assert meta["finish_reason"]["type"] == "length"
    ids_seen: list[int] = []
    with httpx.stream(
        "POST", f"{stack.url}/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                ids_seen = event["output_ids"]
                last_text = event["text"]
    assert ids_seen == reference["output_ids"] and last_text == reference["text"]
    flushed = httpx.post(f"{stack.url}/flush_cache", timeout=30)
    assert flushed.status_code == 200


# Two candidates whose logprobs differ by less than this are a tie to greedy decoding: a
# batch of another composition (another GEMM blocking) may round either one higher.
GREEDY_TIE = 1e-3


def test_sixteen_concurrent_greedy_requests_equal_the_engine(
    stack: RunningStack, engine: Engine
) -> None:
    """The stack's batches are not the engine's, and greedy tokens may then differ where
    two candidates tie within rounding (the engine promises no batch invariance): each
    answer equals the engine's up to its first token, and a first difference must be
    such a tie in the engine's own top-2, the stack having taken the other of the two."""
    prompts = make_prompts(engine.runner.vocab_size, [5 + 7 * i for i in range(16)], seed=9)
    # ignore_eos: every answer 16 tokens long, so a difference is always at a token.
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    reference = engine.generate(
        input_ids=prompts, sampling_params={**params, "return_logprob": True, "top_logprobs_num": 2}
    )
    assert isinstance(reference, list)

    async def run_all() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as http:
            replies = await asyncio.gather(
                *(
                    http.post(
                        f"{stack.url}/generate", json={"input_ids": p, "sampling_params": params}
                    )
                    for p in prompts
                )
            )
        return [r.json()["output_ids"] for r in replies]

    answers = asyncio.run(run_all())
    for got, want in zip(answers, reference, strict=True):
        expected = want["output_ids"]
        differs = [k for k, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
        if not differs:
            continue
        k = differs[0]
        (first, first_lp), (second, second_lp) = want["meta_info"]["output_top_logprobs"][k][:2]
        assert (expected[k], got[k]) == (first, second), (k, got, expected)
        assert first_lp - second_lp < GREEDY_TIE, (k, first_lp, second_lp)


async def _streamed(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    """A streamed answer's events as a client reads them: the JSON payloads, then [DONE]
    (each event's `id:`, for a resume, is checked to name the request)."""
    events: list[Any] = []
    async with http.stream("POST", url, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        rid = reply.headers["x-request-id"]
        async for line in reply.aiter_lines():
            if line.startswith("id: "):
                assert line.startswith(f"id: {rid}/"), line
            elif line:
                assert line.startswith("data: "), line
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_concurrent_streams_equal_their_answers_unstreamed(
    stack: RunningStack, engine: Engine
) -> None:
    """Sixteen streams at once (the gateway then often has several tokens of a stream
    queued, which go out as one write): each stream's events add up to its request's
    unstreamed answer (and, for the token-id prompts, the engine's): the text, the
    logprob tokens, the one finish reason, and the usage chunk last, before [DONE]."""
    prompts = make_prompts(engine.runner.vocab_size, [6 + 5 * i for i in range(8)], seed=11)
    params = {"temperature": 0, "max_new_tokens": 16}
    reference = engine.generate(input_ids=prompts, sampling_params=params)
    assert isinstance(reference, list)
    common = {"model": stack.model, "temperature": 0, "max_tokens": 16}
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completions", {**common, "prompt": p, "logprobs": 1}) for p in prompts
    ]
    bodies += [
        ("chat/completions", {**common, "messages": [{"role": "user", "content": f"Hi {i}"}]})
        for i in range(8)
    ]
    for _, body in bodies[8:]:
        body |= {"logprobs": True, "top_logprobs": 1}

    async def run_all() -> tuple[list[Any], list[list[Any]]]:
        async with httpx.AsyncClient(base_url=f"{stack.url}/v1", timeout=120) as http:
            whole = [(await http.post(f"/{path}", json=body)).json() for path, body in bodies]
            usage = {"stream_options": {"include_usage": True}}
            streams = await asyncio.gather(
                *(_streamed(http, f"/{path}", {**body, **usage}) for path, body in bodies)
            )
        return whole, list(streams)

    whole, streams = asyncio.run(run_all())
    for (path, _), answer, events in zip(bodies, whole, streams, strict=True):
        *chunks, usage_chunk, done = events
        assert done == "[DONE]"
        assert usage_chunk["choices"] == [] and all(c["usage"] is None for c in chunks)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage_chunk["usage"][key] == answer["usage"][key], key
        choices = [c["choices"][0] for c in chunks]
        assert all(len(c["choices"]) == 1 for c in chunks)
        (expected,) = answer["choices"]
        reasons = [c["finish_reason"] for c in choices]
        assert reasons[-1] == expected["finish_reason"] and reasons.count(None) == len(reasons) - 1
        if path == "completions":
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert text == expected["text"] and tokens == expected["logprobs"]["tokens"]
        else:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["delta"].get("content") or "" for c in choices)
            tokens = [
                e["token"] for c in choices if c["logprobs"] for e in c["logprobs"]["content"]
            ]
            assert text == expected["message"]["content"]
            assert tokens == [e["token"] for e in expected["logprobs"]["content"]]
    assert [w["choices"][0]["text"] for w in whole[:8]] == [r["text"] for r in reference]


def test_request_record_is_kept(client: openai.OpenAI, stack: RunningStack) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    rid = raw.headers["x-request-id"]
    assert rid == raw.parse().id
    record: dict[str, object] = {}
    for _ in range(50):  # fire-and-forget writes land shortly after the reply
        record = httpx.get(f"{stack.url}/v1/requests/{rid}", timeout=10).json()
        if record.get("state") == "finished":
            break
        time.sleep(0.1)
    assert record["state"] == "finished" and int(str(record["completion_tokens"])) == 3
    assert record["worker"] == "worker-0"
    for stamp in ("received_at", "queued_at", "first_token_at", "finished_at"):
        assert isinstance(record[stamp], float), stamp
    assert httpx.get(f"{stack.url}/v1/requests/nope", timeout=10).status_code == 404


def _error(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_errors(stack: RunningStack) -> None:
    url = f"{stack.url}/v1/chat/completions"
    ok = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = httpx.post(url, json={**ok, "temperature": -1}, timeout=30)
    assert bad.status_code == 400 and _error(bad)["param"] == "temperature"
    malformed = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert malformed.status_code == 400
    too_long = httpx.post(url, json={**ok, "max_tokens": CONTEXT}, timeout=30)
    assert too_long.status_code == 400 and _error(too_long)["code"] == "context_length_exceeded"
    unknown = httpx.post(url, json={**ok, "model": "no-such-model"}, timeout=30)
    assert unknown.status_code == 404
    bad_grammar = httpx.post(url, json={**ok, "regex": "[ab"}, timeout=30)
    assert bad_grammar.status_code == 400
    assert (_error(bad_grammar)["code"], _error(bad_grammar)["param"]) == (
        "invalid_grammar",
        "regex",
    )
    grammar = httpx.post(url, json={**ok, "regex": "[ab]{3}", "max_tokens": 8}, timeout=30)
    assert grammar.status_code == 200
    assert re.fullmatch("[ab]{3}", grammar.json()["choices"][0]["message"]["content"])
    # A request past the gateway's deadline (20 s here) is a 504, and it is aborted.
    slow = {**ok, "max_tokens": 90_000, "ignore_eos": True}
    timed_out = httpx.post(url, json=slow, timeout=60)
    assert timed_out.status_code == 504 and _error(timed_out)["code"] == "timeout"


async def wait_for_idle_worker(bus: Bus, subjects: protocol.Subjects) -> list[protocol.WorkerStats]:
    """Wait (30 s at most) until the worker reports nothing running or queued: earlier
    tests' timed-out and aborted requests are gone. Returns the live list of its stats."""
    stats: list[protocol.WorkerStats] = []

    async def on_stats(msg: BusMsg) -> None:
        stats.append(protocol.decode(msg.data, protocol.WorkerStats))

    await bus.subscribe(subjects.stats_all, on_stats)
    deadline = time.monotonic() + 30
    while not (stats and stats[-1].num_running_reqs == 0 and stats[-1].num_queue_reqs == 0):
        assert time.monotonic() < deadline, "the worker never went idle"
        await asyncio.sleep(0.05)
    return stats


def test_queue_bound_gives_429(stack: RunningStack) -> None:
    """24 requests in flight (the scheduler's bound here): the next ones get 429."""
    url = f"{stack.url}/v1/completions"
    body = {"model": stack.model, "prompt": "x", "max_tokens": 60_000, "ignore_eos": True}
    holder_deadline_s = 20  # the gateway's --request-timeout-s: holders end then

    async def scenario() -> list[httpx.Response]:
        bus = await Bus.connect(stack.nats_url)
        subjects = protocol.Subjects(stack.subject_prefix)
        # A request still in flight from an earlier test (the 504 one) would take a
        # place in the bound, turn a holder into a 429 and leave the extras waiting.
        await wait_for_idle_worker(bus, subjects)
        routed: list[str] = []

        async def on_run(msg: BusMsg) -> None:
            routed.append(protocol.decode(msg.data, protocol.RoutedRequest).rid)

        await bus.subscribe(subjects.worker_run_all, on_run)
        async with httpx.AsyncClient(timeout=60) as http:
            started = time.monotonic()
            holders = [asyncio.create_task(http.post(url, json=body)) for _ in range(24)]
            while len(routed) < 24 and not any(task.done() for task in holders):
                assert time.monotonic() - started < holder_deadline_s / 2, (
                    f"only {len(routed)} of 24 requests routed in {holder_deadline_s / 2}s"
                )
                await asyncio.sleep(0.02)
            done = [task.result() for task in holders if task.done()]
            assert not done, f"a holder ended early: {done[0].status_code} {done[0].text}"
            extra = await asyncio.gather(*(http.post(url, json=body) for _ in range(3)))
            assert time.monotonic() - started < holder_deadline_s, "the holders timed out"
            for task in holders:  # the client goes away: the gateway aborts them
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
        await bus.close()
        return list(extra)

    for response in asyncio.run(scenario()):
        assert response.status_code == 429, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert _error(response)["code"] == "queue_full"


def test_client_disconnect_frees_kv_within_a_second(stack: RunningStack) -> None:
    async def scenario() -> tuple[float, protocol.WorkerStats]:
        bus = await Bus.connect(stack.nats_url)
        subjects = protocol.Subjects(stack.subject_prefix)
        aborted: dict[str, float] = {}

        async def on_detok(msg: BusMsg) -> None:
            for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                reason = out.finish_reason
                if reason is not None and reason.kind == "abort":
                    aborted[out.rid] = time.monotonic()

        await bus.subscribe(subjects.detok, on_detok)
        stats = await wait_for_idle_worker(bus, subjects)
        body = {
            "model": stack.model,
            "prompt": "x",
            "max_tokens": 60_000,
            "ignore_eos": True,
            "stream": True,
        }
        # Not resumable: a client gone aborts its request at once (a resumable one runs on
        # for the resume grace).
        headers = {"X-Resumable": "false"}
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream(
                "POST", f"{stack.url}/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                rid = response.headers["x-request-id"]
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        break
                assert events == 3, "the stream ended early"
            closed_at = time.monotonic()
        while rid not in aborted:
            await asyncio.sleep(0.01)
            assert time.monotonic() - closed_at < 5, "the request was never aborted"
        seen = len(stats)
        while len(stats) < seen + 2:
            await asyncio.sleep(0.05)
        await bus.close()
        return aborted[rid] - closed_at, stats[-1]

    took, last = asyncio.run(scenario())
    assert took < 1.0, f"KV freed {took:.2f}s after the client went away"
    assert last.num_running_reqs == 0
    assert last.free_kv_tokens + last.evictable_kv_tokens == last.total_kv_tokens


def test_no_worker_gives_503(stack: RunningStack) -> None:
    """Last: it kills the worker."""
    for item in stack.stack.services:
        if item.name.startswith("worker"):
            item.process.kill()
    url = f"{stack.url}/v1/completions"
    body = {"model": stack.model, "prompt": "x", "max_tokens": 2}
    deadline = time.monotonic() + 20
    response = httpx.post(url, json=body, timeout=30)
    while response.status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.5)
        response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == 503 and "retry-after" in response.headers
