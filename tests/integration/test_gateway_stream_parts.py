"""A streamed answer's parts (`stream_parts`, services/gateway/generation.py): the updates
already there for a request go out as one part (one socket write), each still its own
SSE event in order, and nothing waits for more.

Real objects on real NATS and Redis: the gateway's `Hub` subscribed on the bus, an
`Inflight` of a real plan, `TextDeltaBatch`es published as the detokenizer publishes
them. Reference: the same deltas put through a fresh `Assembly` and streamer one at a
time (what the gateway sent before parts were joined), then the usage chunk and [DONE].
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from radixserve.api import (
    SSE_DONE,
    ApiError,
    Assembly,
    ChatCompletionRequest,
    ChoiceUpdate,
    CompletionRequest,
    GenerationPlan,
    make_streamer,
    parse_body,
    plan_chat,
    plan_completion,
    sse,
)
from radixserve.bus import Bus
from radixserve.protocol import (
    FinishReason,
    LogprobEntry,
    RequestError,
    TextDelta,
    TextDeltaBatch,
    TopLogprobEntry,
    encode,
    pack_tokens,
)
from radixserve.services.gateway.aborts import AbortSender
from radixserve.services.gateway.generation import stream_parts
from radixserve.services.gateway.hub import Hub
from radixserve.services.gateway.inflight import Inflight
from radixserve.services.gateway.records import RecordWriter
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.gateway.state import GatewayState
from radixserve.services.gateway.workers import WorkerTracker
from radixserve.services.runtime import ServiceSettings
from radixserve.store import Store, StoreSettings
from radixserve.telemetry import GatewayMetrics

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
TOKENS = [" The", " radix", " tree", " keeps", " prefixes"]
BODIES: dict[str, dict[str, Any]] = {
    "chat": {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "logprobs": True,
        "top_logprobs": 1,
    },
    "completion": {"model": "m", "prompt": "x", "logprobs": 1},
}


@pytest.fixture
async def state(nats_url: str, redis_url: str) -> AsyncIterator[GatewayState]:
    """One gateway's state, its hub taking the deltas of its subjects off the bus."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    service = ServiceSettings(
        service="gateway", nats_url=nats_url, redis_url=redis_url, subject_prefix=prefix
    )
    settings = GatewaySettings(service=service, store=StoreSettings(url=redis_url))
    bus = await Bus.connect(nats_url)
    metrics = GatewayMetrics()
    store = Store(settings.store)
    gateway = GatewayState(
        settings=settings,
        bus=bus,
        hub=Hub(service.subjects, settings.gateway_id),
        aborts=AbortSender(bus, service.subjects),
        records=RecordWriter(store, ttl_s=60, metrics=metrics),
        metrics=metrics,
        workers=WorkerTracker(metrics, 5.0),
    )
    await bus.subscribe(service.subjects.gateway_all(settings.gateway_id), gateway.hub.on_message)
    yield gateway
    await bus.close()
    await store.close()


def make_plan(state: GatewayState, endpoint: str) -> GenerationPlan:
    body = {**BODIES[endpoint], "max_tokens": len(TOKENS), "stream": True}
    body["stream_options"] = {"include_usage": True}
    raw = json.dumps(body).encode()
    common: dict[str, Any] = {
        "response_id": f"id-{uuid.uuid4().hex}",
        "gateway_id": state.gateway_id,
        "served_model": "m",
        "arrival_time": 0.0,
    }
    if endpoint == "chat":
        return plan_chat(parse_body(ChatCompletionRequest, raw), **common)
    return plan_completion(parse_body(CompletionRequest, raw), **common)


def deltas(plan: GenerationPlan) -> list[TextDelta]:
    """The answer, a token a delta, cut by its length on the last one."""
    out = []
    for i, token in enumerate(TOKENS):
        top = [TopLogprobEntry(token_id=i, token=token, logprob=-0.25)]
        out.append(
            TextDelta(
                rid=plan.rids[0],
                text=token,
                token_ids=pack_tokens([i]),
                finish_reason=FinishReason(kind="length") if i == len(TOKENS) - 1 else None,
                prompt_tokens=3,
                completion_tokens=i + 1,
                cached_tokens=1,
                logprobs=[LogprobEntry(token_id=i, token=token, logprob=-0.25, top=top)],
            )
        )
    return out


async def publish(state: GatewayState, batch: list[TextDelta]) -> None:
    subject = state.subjects.gateway_deltas(state.gateway_id)
    await state.bus.publish(subject, encode(TextDeltaBatch(state.gateway_id, batch)))


def created_of(part: bytes) -> int:
    found = re.search(rb'"created":(\d+)', part)
    assert found is not None, part
    return int(found.group(1))


def one_at_a_time(
    plan: GenerationPlan, sent: list[TextDelta], created: int, first: int = 0
) -> list[bytes]:
    """The events of `sent[first:]`, each delta applied and streamed alone (after the
    earlier ones), and the usage chunk once the answer is done."""
    assembly = Assembly(plan)
    streamer = make_streamer(plan, assembly, created)
    events: list[bytes] = []
    for i, delta in enumerate(sent):
        update = assembly.apply(delta)
        assert update is not None
        streamed = streamer.events(update, 0.0)
        if i >= first:
            events += streamed
    return events + (streamer.final(assembly) if assembly.done else [])


def split_events(part: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in part.split(b"\n\n")[:-1]]


async def next_part(parts: AsyncIterator[bytes]) -> bytes:
    return await asyncio.wait_for(anext(parts), WAIT_S)


async def started(
    state: GatewayState, endpoint: str, published: int
) -> tuple[GenerationPlan, Inflight, list[TextDelta], ChoiceUpdate]:
    """A request in flight, the first `published` of its deltas published in one message,
    and its first update read (as `handle_generation` reads it before streaming)."""
    plan = make_plan(state, endpoint)
    run = Inflight(state, plan)
    sent = deltas(plan)
    await publish(state, sent[:published])
    first = await asyncio.wait_for(run.next_update(), WAIT_S)
    return plan, run, sent, first


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_updates_queued_together_go_out_as_one_part_of_separate_events(
    state: GatewayState, endpoint: str
) -> None:
    # One message: all five are queued when the first is read.
    plan, run, sent, first = await started(state, endpoint, len(TOKENS))
    parts = [part async for part in stream_parts(run, first)]
    assert len(parts) == 1
    expected = [*one_at_a_time(plan, sent, created_of(parts[0])), SSE_DONE]
    assert split_events(parts[0]) == expected
    # As a client reads them: one content event a token, the finish, the usage last.
    payloads = [json.loads(e[len(b"data: ") : -2]) for e in expected[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert all(p["usage"] is None for p in payloads[:-1])
    choices = [p["choices"][0] for p in payloads[:-1]]
    reasons = [c["finish_reason"] for c in choices]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    if endpoint == "chat":
        texts = [c["delta"].get("content") or "" for c in choices]
        tokens = [lp["token"] for c in choices if c["logprobs"] for lp in c["logprobs"]["content"]]
    else:
        texts = [c["text"] for c in choices]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert "".join(texts) == "".join(TOKENS) and tokens == TOKENS


async def test_a_part_never_waits_for_updates_still_to_come(state: GatewayState) -> None:
    plan, run, sent, first = await started(state, "chat", 2)
    parts = stream_parts(run, first)
    part = await next_part(parts)  # out before the rest was even published
    created = created_of(part)
    assert split_events(part) == one_at_a_time(plan, sent[:2], created)
    await publish(state, sent[2:])
    last = await next_part(parts)
    assert split_events(last) == [*one_at_a_time(plan, sent, created, first=2), SSE_DONE]
    with pytest.raises(StopAsyncIteration):
        await next_part(parts)


async def test_an_error_behind_queued_updates_follows_their_events(state: GatewayState) -> None:
    plan, run, sent, first = await started(state, "completion", 3)
    error = RequestError(rid=plan.rids[0], code="oops", message="worker lost", http_status=503)
    assert state.hub.deliver(plan.rids[0], error)  # as the bus delivers it, behind the deltas
    parts = [part async for part in stream_parts(run, first)]
    assert len(parts) == 1
    expected = one_at_a_time(plan, sent[:3], created_of(parts[0]))
    expected += [sse(ApiError.from_request_error(error).body()), SSE_DONE]
    assert split_events(parts[0]) == expected
