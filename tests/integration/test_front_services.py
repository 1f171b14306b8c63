"""The tokenizer, grammar and scheduler services on the request path, as subprocesses on
real NATS (tests/fixtures/front.py): prompts tokenized and routed, refusals, grammars,
aborts, flushes, checked against the tokenizer itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.bus import Bus
from radixserve.model_files.tokenizer import apply_chat_template
from radixserve.protocol import (
    AbortRequest,
    ChatMessage,
    RequestError,
    RoutedRequest,
    SamplingParams,
    TokenizedRequest,
    decode,
    encode,
    pack_tokens,
)
from tests.fixtures.front import (
    CONTEXT,
    Inbox,
    Services,
    fake_workers,
    new_gateway,
    new_id,
)

pytestmark = pytest.mark.timeout(120)


# -- the request path ----------------------------------------------------------------------------


async def test_prompts_are_tokenized_and_routed_to_the_least_loaded_worker(
    front: Services, bus: Bus, tokenizer: Any
) -> None:
    gateway = await new_gateway(bus, front.subjects)
    busy, idle = new_id("wbusy"), new_id("widle")
    messages = [{"role": "user", "content": "What is 2 + 2? Réponds en français."}]
    text = "The quick brown fox jumps over the lazy dog"
    ids = [17, 4_000, 49_151]
    expected = {
        "text": tokenizer.encode(text),
        "messages": apply_chat_template(tokenizer, messages),
        "ids": ids,
    }
    async with fake_workers(bus, front.subjects, {busy: 50, idle: 0}) as workers:
        rids = {
            "text": await gateway.submit(text=text),
            "messages": await gateway.submit(
                messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],
                sampling=SamplingParams(max_new_tokens=7, n=2, stop=["\n"]),
            ),
            "ids": await gateway.submit(input_ids=pack_tokens(ids)),
        }
        got: dict[str, RoutedRequest] = {}
        for _ in rids:
            msg = await workers.runs.next_msg()
            routed = decode(msg.data, RoutedRequest)
            assert msg.subject == front.subjects.worker_run(routed.worker_id)
            got[routed.rid] = routed
    for kind, rid in rids.items():
        routed = got[rid]
        assert routed.worker_id == idle, kind
        assert routed.request.input_ids_list == expected[kind], kind
        assert routed.request.gateway_id == gateway.gateway_id
        assert routed.routed_at > 0
    chat = got[rids["messages"]].request
    assert chat.sampling == SamplingParams(max_new_tokens=7, n=2, stop=["\n"])
    assert tokenizer.decode(chat.input_ids_list).endswith("<|im_start|>assistant\n")
    # None failed on the way; their worker then said "stopping" with all three unfinished
    # and no other worker there: each gets worker_lost (and nothing else comes).
    lost = [await gateway.error() for _ in rids]
    assert sorted((e.rid, e.code) for e in lost) == sorted(
        (r, "worker_lost") for r in rids.values()
    )
    await asyncio.sleep(0.3)
    assert gateway.errors.messages.empty()


async def test_refusals_reach_the_gateway_with_code_and_param(
    front: Services, bus: Bus, tokenizer: Any
) -> None:
    gateway = await new_gateway(bus, front.subjects)
    text = "Hello there"
    n_prompt = len(tokenizer.encode(text))
    over = SamplingParams(max_new_tokens=CONTEXT - n_prompt + 1)
    rid = await gateway.submit(text=text, sampling=over)
    error = await gateway.error()
    assert (error.rid, error.http_status, error.code, error.param) == (
        rid,
        400,
        "context_length_exceeded",
        "prompt",
    )
    assert error.message.startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{CONTEXT + 1} tokens ({n_prompt} in the prompt, {CONTEXT - n_prompt + 1} in the completion)."
    )

    chat = [ChatMessage(role="user", content="hi")]
    rid = await gateway.submit(messages=chat, sampling=SamplingParams(max_new_tokens=CONTEXT))
    error = await gateway.error()
    assert (error.rid, error.code, error.param) == (rid, "context_length_exceeded", "messages")

    rid = await gateway.submit(input_ids=pack_tokens([1, len(tokenizer)]))
    error = await gateway.error()
    assert (error.rid, error.http_status, error.param) == (rid, 400, "prompt")
    assert f"token id {len(tokenizer)} is outside the vocabulary" in error.message

    rid = await gateway.submit(text="")
    error = await gateway.error()
    assert (error.rid, error.http_status) == (rid, 400)

    # Not a valid SubmitRequest (two prompts): still answered, by rid, not dropped.
    body = {"rid": "r-bad", "gateway_id": gateway.gateway_id, "text": "a", "input_ids": b""}
    await bus.publish(front.subjects.tokenize, msgspec.msgpack.encode(body))
    error = await gateway.error()
    assert (error.rid, error.http_status) == ("r-bad", 400)
    assert "exactly one of text, input_ids, messages" in error.message


async def test_grammars_are_compiled_and_routed_by_key_or_refused_with_the_reason(
    front: Services, bus: Bus, model_dir: Path
) -> None:
    from radixserve.model_files.tokenizer import tokenizer_id
    from radixserve.protocol import grammar_key

    gateway = await new_gateway(bus, front.subjects)
    async with fake_workers(bus, front.subjects, {new_id("w"): 0}) as workers:
        rid = await gateway.submit(text="Pick a digit:", sampling=SamplingParams(regex="[0-9]"))
        routed = decode((await workers.runs.next_msg(timeout_s=30)).data, RoutedRequest)
    assert routed.rid == rid
    assert routed.request.grammar_key == grammar_key("regex", "[0-9]", tokenizer_id(model_dir))
    assert routed.request.sampling.regex == "[0-9]"  # the worker can compile it itself
    # Its worker said "stopping" without finishing it, and no other worker is there.
    lost = await gateway.error()
    assert (lost.rid, lost.code) == (rid, "worker_lost")

    rid = await gateway.submit(text="Pick:", sampling=SamplingParams(regex="[0-"))
    error = await gateway.error()
    assert (error.rid, error.http_status, error.code, error.param) == (
        rid,
        400,
        "invalid_grammar",
        "regex",
    )
    assert "Unclosed '['" in error.message


async def test_aborts_reach_the_worker_or_drop_a_request_not_routed_yet(
    front: Services, bus: Bus
) -> None:
    gateway = await new_gateway(bus, front.subjects)
    w0, w1 = new_id("wa"), new_id("wb")
    async with fake_workers(bus, front.subjects, {w0: 0, w1: 9}) as workers:
        rid = await gateway.submit(text="Tell me a long story")
        routed = await workers.runs.next(RoutedRequest)
        assert (routed.rid, routed.worker_id) == (rid, w0)
        await bus.publish(front.subjects.abort, encode(AbortRequest(rid=rid, reason="client left")))
        msg = await workers.aborts.next_msg()
        assert msg.subject == front.subjects.worker_abort(w0)
        assert decode(msg.data, AbortRequest) == AbortRequest(rid=rid, reason="client left")

        # The abort overtakes its request: the request is never routed; the next one is.
        early = new_id("r")
        await bus.publish(front.subjects.abort, encode(AbortRequest(rid=early)))
        await bus.nats_client.flush()
        await asyncio.sleep(0.2)  # the abort is handled before the tokenizer's output
        await gateway.submit(rid=early, text="never runs")
        after = await gateway.submit(text="runs")
        routed = await workers.runs.next(RoutedRequest)
        assert routed.rid == after
        await asyncio.sleep(0.3)
        assert workers.runs.messages.empty()
        assert workers.aborts.messages.empty()


async def test_the_tokenizer_drops_a_request_aborted_before_it_was_tokenized(
    front: Services, bus: Bus
) -> None:
    # A request acknowledged by the tokenizer can wait behind a backlog while its gateway
    # answers 503 and aborts it: the tokenizer must not tokenize and schedule it then.
    gateway = await new_gateway(bus, front.subjects)
    scheduled = Inbox()
    await bus.subscribe(front.subjects.schedule, scheduled.handler)  # a tap: sees every one
    late = new_id("r")
    await bus.publish(front.subjects.abort, encode(AbortRequest(rid=late, reason="timeout")))
    await bus.nats_client.flush()
    await asyncio.sleep(0.2)  # every tokenizer replica has heard the abort
    await gateway.submit(rid=late, text="nobody waits for this")
    after = await gateway.submit(text="this one goes on")
    assert (await scheduled.next(TokenizedRequest)).rid == after
    await asyncio.sleep(0.3)
    assert scheduled.messages.empty()
    # No worker runs here: `after` gets the scheduler's 503; `late` nothing at all (its
    # gateway answered it already).
    errors = []
    while not gateway.errors.messages.empty():
        errors.append(await gateway.errors.next(RequestError))
    assert [e.rid for e in errors] == [after]


async def test_flush_cache_fans_out_and_is_ok_only_when_all_are(front: Services, bus: Bus) -> None:
    w0, w1 = new_id("wf"), new_id("wg")
    async with fake_workers(bus, front.subjects, {w0: 0, w1: 0}) as workers:
        reply = await workers.flush("flush-1")
        assert (reply.rid, reply.ok) == ("flush-1", True)
        assert workers.flushes[w0][-1] == workers.flushes[w1][-1] == "flush-1"
        workers.flush_ok = False
        reply = await workers.flush("flush-2")
        assert not reply.ok
        assert f"{w0}: busy" in reply.message and f"{w1}: busy" in reply.message
