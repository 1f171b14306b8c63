"""The scheduler and tokenizer when a request cannot go on: no worker, a full queue, a run
that cannot be sent, and acknowledged sends that nobody takes (tests/fixtures/front.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from radixserve.bus import Bus
from radixserve.protocol import (
    AbortRequest,
    InflightQuery,
    InflightReply,
    RoutedRequest,
    SamplingParams,
    Subjects,
    SubmitRequest,
    TokenizedRequest,
    decode,
    encode,
    pack_tokens,
    retry_later_error,
)
from tests.fixtures.front import (
    CONTEXT,
    WAIT_S,
    FakeWorkers,
    Gateway,
    Inbox,
    Services,
    fake_workers,
    new_gateway,
    new_id,
    start_services,
)

pytestmark = pytest.mark.timeout(120)


# -- backpressure, on a scheduler of its own -------------------------------------------------------


async def test_scheduler_answers_503_without_workers_and_429_over_its_bound(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    flags = ["--max-pending-requests", "2", "--worker-timeout-s", "1", "--retry-after-s", "3"]
    scheduler = await asyncio.to_thread(start_services, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await new_gateway(bus, subjects)

        await gateway.schedule("r-none")
        error = await gateway.error()
        assert (error.rid, error.http_status, error.code, error.retry_after_s) == (
            "r-none",
            503,
            "no_worker",
            3.0,
        )

        worker = new_id("w")
        workers = FakeWorkers(bus, subjects, {worker: 0})
        await workers.start()
        for rid in ("r1", "r2", "r3"):
            await gateway.schedule(rid)
        assert {(await workers.runs.next(RoutedRequest)).rid for _ in range(2)} == {"r1", "r2"}
        error = await gateway.error()
        assert (error.rid, error.http_status, error.code, error.retry_after_s) == (
            "r3",
            429,
            "queue_full",
            3.0,
        )

        await workers.finish(worker, "r1", gateway.gateway_id)  # frees one place
        await bus.nats_client.flush()
        await asyncio.sleep(0.2)
        await gateway.schedule("r4")
        assert (await workers.runs.next(RoutedRequest)).rid == "r4"

        # The worker goes silent: what it holds is lost.
        assert workers._beating is not None
        workers._beating.cancel()
        lost = [await gateway.error() for _ in range(2)]
        assert sorted((e.rid, e.http_status, e.code) for e in lost) == [
            ("r2", 503, "worker_lost"),
            ("r4", 503, "worker_lost"),
        ]
    finally:
        scheduler.stop()


async def test_a_request_the_scheduler_cannot_send_to_its_worker_is_refused_not_leaked(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    # A tokenized request just under NATS's payload limit: routed, it grows past it, the
    # scheduler's publish fails, and the request must not keep its place in flight.
    flags = ["--max-pending-requests", "1"]
    scheduler = await asyncio.to_thread(start_services, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await new_gateway(bus, subjects)
        worker = new_id("w")
        async with fake_workers(bus, subjects, {worker: 0}) as workers:
            limit = bus.nats_client.max_payload

            n = (limit - len(gateway.tokenized("r-big", []))) // 4 - 2
            big = gateway.tokenized("r-big", [7] * n)
            assert limit - 16 < len(big) <= limit
            await bus.publish(subjects.schedule, big)
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-big", 413, "request_too_large")
            assert error.retry_after_s is None  # sending it again cannot succeed
            # Its place is free: with one place in all, the next request is routed.
            await gateway.schedule("r-next", [7, 7])
            assert (await workers.runs.next(RoutedRequest)).rid == "r-next"
    finally:
        scheduler.stop()


# -- acknowledged sends: a request nobody takes is answered, not left to the timeout ---------


async def test_the_tokenizer_and_the_scheduler_acknowledge_what_they_receive(
    front: Services, bus: Bus
) -> None:
    subjects = front.subjects
    gateway = await new_gateway(bus, subjects)
    submit = SubmitRequest(
        rid=new_id("r"), gateway_id=gateway.gateway_id, sampling=SamplingParams(), text="hi"
    )
    reply = await bus.request(subjects.tokenize, encode(submit), timeout_s=WAIT_S)
    assert reply.data == b""
    tokenized = TokenizedRequest(
        rid=new_id("r"), gateway_id=gateway.gateway_id, input_ids=pack_tokens([1, 2])
    )
    reply = await bus.request(subjects.schedule, encode(tokenized), timeout_s=WAIT_S)
    assert reply.data == b""


async def test_the_tokenizer_answers_503_when_no_scheduler_takes_the_request(
    nats_url: str, bus: Bus, model_dir: Path, tmp_path: Path
) -> None:
    flags = ["--model", str(model_dir), "--context-length", str(CONTEXT)]
    flags += ["--schedule-ack-timeout-s", "0.5"]
    tokenizer = await asyncio.to_thread(start_services, nats_url, tmp_path, {"tokenizer": flags})
    try:
        subjects = tokenizer.subjects
        gateway = await new_gateway(bus, subjects)
        # No scheduler at all: the server says so at once.
        rid = await gateway.submit(text="hello")
        error = await gateway.error()
        assert (error.rid, error.http_status, error.code) == (rid, 503, "scheduler_unreachable")
        assert error.retry_after_s == 1.0
        assert "no scheduler is running" in error.message
        # One that takes requests but never acknowledges (as if the message were lost):
        # 503 after the ack timeout, and an abort in case the request arrives after all.
        received, aborts = Inbox(), Inbox()
        await bus.subscribe(subjects.schedule, received.handler, queue="scheduler")
        await bus.subscribe(subjects.abort, aborts.handler, queue="scheduler")
        rid = await gateway.submit(text="hello again")
        error = await gateway.error()
        assert (error.rid, error.http_status, error.code) == (rid, 503, "scheduler_unreachable")
        assert "did not acknowledge the request within 0.5 s" in error.message
        assert (await received.next(TokenizedRequest)).rid == rid
        abort = await aborts.next(AbortRequest)
        assert (abort.rid, abort.reason) == (rid, "scheduler_unresponsive")
    finally:
        tokenizer.stop()


async def test_a_run_no_worker_acknowledges_is_refused_and_aborted(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    flags = ["--worker-ack-timeout-s", "0.5"]
    scheduler = await asyncio.to_thread(start_services, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await new_gateway(bus, subjects)

        worker = new_id("w")
        async with fake_workers(bus, subjects, {worker: 0}) as workers:
            # It takes the run but never acknowledges (as if the message were lost).
            workers.ack = False
            await gateway.schedule("r-silent")
            assert (await workers.runs.next(RoutedRequest)).rid == "r-silent"
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-silent", 503, "worker_lost")
            assert "did not acknowledge the request within 0.5 s" in error.message
            abort = await workers.aborts.next(AbortRequest)
            assert (abort.rid, abort.reason) == ("r-silent", "not_acknowledged")
            # An acknowledged run stays in flight past the ack timeout.
            workers.ack = True
            await gateway.schedule("r-ok")
            assert (await workers.runs.next(RoutedRequest)).rid == "r-ok"
            await asyncio.sleep(1.5)
            assert gateway.errors.messages.empty()
            await workers.finish(worker, "r-ok", gateway.gateway_id)
        # A worker that heartbeats but does not listen for runs: NATS says so at once.
        deaf = FakeWorkers(bus, subjects, {new_id("w"): 0}, listen=False)
        await deaf.start()
        try:
            await gateway.schedule("r-deaf")
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-deaf", 503, "worker_lost")
            assert "does not listen for requests" in error.message
        finally:
            await deaf.stop()
    finally:
        scheduler.stop()


@contextlib.asynccontextmanager
async def scheduler_and_worker(
    nats_url: str, bus: Bus, tmp_path: Path
) -> AsyncIterator[tuple[Subjects, Gateway, str, FakeWorkers]]:
    """A scheduler of its own (default flags), the test's gateway and one fake worker."""
    scheduler = await asyncio.to_thread(start_services, nats_url, tmp_path, {"scheduler": []})
    try:
        subjects = scheduler.subjects
        gateway = await new_gateway(bus, subjects)
        worker = new_id("w")
        async with fake_workers(bus, subjects, {worker: 0}) as workers:
            yield subjects, gateway, worker, workers
    finally:
        scheduler.stop()


async def test_a_request_another_service_fails_is_aborted_at_its_worker(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    # The detokenizer fails a running request (output_lost): the error reaches the
    # scheduler, which takes it out of flight and tells its worker to stop generating it.
    # A request the worker itself refused gets no abort (it is gone there already).
    async with scheduler_and_worker(nats_url, bus, tmp_path) as (subjects, gateway, _, workers):
        for rid in ("r-lost", "r-refused"):
            await gateway.schedule(rid)
            assert (await workers.runs.next(RoutedRequest)).rid == rid
        refused = retry_later_error("r-refused", "grammar_unavailable", "no grammar", "worker")
        lost = retry_later_error("r-lost", "output_lost", "part of it was lost", "detokenizer")
        for error in (refused, lost):
            await bus.publish(subjects.gateway_errors(gateway.gateway_id), encode(error))
        abort = await workers.aborts.next(AbortRequest)
        assert (abort.rid, abort.reason) == ("r-lost", "output_lost")
        await asyncio.sleep(0.5)
        assert workers.aborts.messages.empty()


async def test_the_scheduler_says_which_requests_are_in_flight(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    async with scheduler_and_worker(nats_url, bus, tmp_path) as (
        subjects,
        gateway,
        worker,
        workers,
    ):

        async def ask(*rids: str) -> InflightReply:
            query = encode(InflightQuery(rids=list(rids)))
            raw = await bus.request(subjects.scheduler_inflight, query, timeout_s=WAIT_S)
            return decode(raw.data, InflightReply)

        await gateway.schedule("r-run")
        assert (await workers.runs.next(RoutedRequest)).rid == "r-run"
        reply = await ask("r-run", "r-never")
        assert (reply.inflight, reply.ended) == (["r-run"], {})
        await workers.finish(worker, "r-run", gateway.gateway_id)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while (reply := await ask("r-run", "r-never")).inflight:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert list(reply.ended) == ["r-run"] and 0 <= reply.ended["r-run"] < WAIT_S
