"""A client whose connection drops resumes its stream at another gateway replica with
Last-Event-ID (real NATS, Redis and service processes, the tiny random model on the CPU).

Each request is first streamed whole (the reference). Then again, cut after a few
events; the client sends the last event id it had to a second gateway (re-POSTed, or
`GET /v1/requests/{id}/output`), which rebuilds the stream from the detokenizer's output
log in Redis: the events that follow, exactly, and nothing twice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.gateway import WAIT_S, Gateway, start_gateway
from tests.integration.stack_fixture import RunningStack
from tests.integration.stack_load import Events, body, read_events

MAX_TOKENS = 200
CUT_AFTER = 8  # text events the first connection gets


@pytest.fixture(scope="module")
def other_gateway(
    tiny_stack: RunningStack, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """A second gateway replica of the tiny stack."""
    log_path = tmp_path_factory.mktemp("resume_gateway") / "gateway.log"
    yield from start_gateway(
        tiny_stack.nats_url, redis_url, log_path, prefix=tiny_stack.subject_prefix
    )


async def stream_whole(url: str, request: dict[str, Any]) -> Events:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            return await read_events(response.aiter_lines(), Events())


async def stream_cut(url: str, request: dict[str, Any]) -> tuple[str, Events]:
    """The stream read for CUT_AFTER text events, then the connection closed."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            rid = response.headers["x-request-id"]
            events = read_events(
                response.aiter_lines(), Events(), lambda e: len(e.texts) >= CUT_AFTER
            )
            return rid, await events


async def resume(
    url: str, last_id: str, method: str = "POST", path: str = "/v1/completions"
) -> Events:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        headers = {"Last-Event-ID": last_id}
        async with http.stream(method, path, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            return await read_events(response.aiter_lines(), Events())


async def test_a_dropped_stream_resumes_at_another_gateway(
    tiny_stack: RunningStack, other_gateway: Gateway
) -> None:
    request = body("Resume me: the numbers go", MAX_TOKENS)
    reference = await stream_whole(tiny_stack.url, request)
    assert reference.done and len(reference.texts) > CUT_AFTER + 10

    rid, first = await stream_cut(tiny_stack.url, request)
    assert first.texts == reference.texts[:CUT_AFTER]
    last_id = first.ids[-1]
    assert last_id is not None and last_id.startswith(rid + "/")

    rest = await resume(other_gateway.base_url, last_id)
    assert rest.texts == reference.texts[CUT_AFTER:]  # each token once, none missing
    assert first.text + rest.text == reference.text
    assert rest.done and rest.usage is not None and reference.usage is not None
    # The second run's prompt was cached: the token counts are the reference's.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [rest.usage[k] for k in counts] == [reference.usage[k] for k in counts]

    # The same from the record's own path, and again (a resume may itself be resumed).
    again = await resume(other_gateway.base_url, last_id, "GET", f"/v1/requests/{rid}/output")
    assert again.texts == rest.texts and again.usage == rest.usage
    later = await resume(tiny_stack.url, rest.ids[5] or "", "GET", f"/v1/requests/{rid}/output")
    assert later.texts == reference.texts[CUT_AFTER + 6 :]

    async with httpx.AsyncClient(base_url=other_gateway.base_url, timeout=10) as http:
        record = (await http.get(f"/v1/requests/{rid}")).json()
    assert record["state"] == "finished" and record["completion_tokens"] == MAX_TOKENS
    assert "resumed_at" in record and "plan" not in record


async def test_a_non_streaming_request_sent_resumable_outlives_its_client(
    tiny_stack: RunningStack, other_gateway: Gateway
) -> None:
    request = body("Wait for me: once upon", MAX_TOKENS, usage=False, stream=False)
    async with httpx.AsyncClient(base_url=tiny_stack.url, timeout=60) as http:
        reference = (await http.post("/v1/completions", json=request)).json()
    rid = f"client-chosen-{uuid.uuid4().hex}"
    async with httpx.AsyncClient(base_url=tiny_stack.url, timeout=0.05) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(
                "/v1/completions",
                json=request,
                headers={"X-Resumable": "true", "X-Request-Id": rid},
            )
    async with httpx.AsyncClient(base_url=other_gateway.base_url, timeout=60) as http:
        # The record is written off the request path: there within moments.
        deadline = time.monotonic() + WAIT_S
        while (await http.get(f"/v1/requests/{rid}")).status_code == 404:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        answer = await http.get(f"/v1/requests/{rid}/output")
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["id"] == rid
        assert result["choices"][0]["text"] == reference["choices"][0]["text"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [result["usage"][k] for k in counts] == [reference["usage"][k] for k in counts]
        taken = await http.post(
            "/v1/completions", json=request, headers={"X-Resumable": "1", "X-Request-Id": rid}
        )
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "duplicate_id"


async def test_resumes_that_cannot_be_answered_say_why(
    tiny_stack: RunningStack, other_gateway: Gateway
) -> None:
    async with httpx.AsyncClient(base_url=other_gateway.base_url, timeout=30) as http:
        plain = body("not resumable", 4, usage=False, stream=False)
        done = await http.post("/v1/completions", json=plain)
        rid = done.headers["x-request-id"]
        cases = [
            ("GET", f"/v1/requests/{rid}/output", {}, 409, "not_resumable"),
            ("GET", "/v1/requests/no-such-request/output", {}, 404, "not_found"),
            ("POST", "/v1/completions", {"Last-Event-ID": "garbage"}, 400, "invalid_request_error"),
            ("POST", "/v1/completions", {"Last-Event-ID": "nope/3"}, 404, "not_found"),
            ("GET", f"/v1/requests/{rid}/output", {"Last-Event-ID": "x/1"}, 400, None),
        ]
        for method, path, headers, status, code in cases:
            answer = await http.request(method, path, headers=headers)
            assert answer.status_code == status, (path, headers, answer.text)
            if code is not None:
                assert answer.json()["error"]["code"] == code
