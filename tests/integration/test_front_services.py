"""The tokenizer, grammar and scheduler services as subprocesses on real NATS.

The test plays the gateway (submits, aborts, flushes; listens on its errors subject)
and the workers (heartbeats, stats, flush replies; listens on the run and abort
subjects), and checks what arrives against the tokenizer itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.bus import Bus, BusMsg, BusSettings, BusSubscription
from radixserve.engine.model.tokenizer import apply_chat_template, load_tokenizer
from radixserve.protocol import (
    AbortRequest,
    ChatMessage,
    FinishReason,
    FlushCacheReply,
    FlushCacheRequest,
    Heartbeat,
    RequestError,
    RoutedRequest,
    SamplingParams,
    ServiceHeartbeat,
    StepOutput,
    StepOutputBatch,
    Subjects,
    SubmitRequest,
    TokenizedRequest,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
    decode,
    encode,
    pack_tokens,
)
from tests.helpers.tiny_models import embedded_model_dir

pytestmark = pytest.mark.timeout(120)

CONTEXT = 512
WAIT_S = 10.0
START_TIMEOUT_S = 90.0
CAPACITY = WorkerCapacity(max_running_requests=8, max_total_num_tokens=4096, max_context_len=512)


def _id(kind: str) -> str:
    return f"{kind}{uuid.uuid4().hex[:8]}"


# -- services as subprocesses -------------------------------------------------------------


@dataclass
class Services:
    subjects: Subjects
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs)


def _start(
    nats_url: str, log_dir: Path, services: dict[str, list[str]], prefix: str | None = None
) -> Services:
    prefix = prefix or _id("t")
    started = Services(Subjects(prefix))
    env = {**os.environ, "RADIXSERVE_LOG_LEVEL": "INFO"}
    try:
        for name, flags in services.items():
            log_path = log_dir / f"{prefix}-{name}.log"
            started.logs.append(log_path)
            with log_path.open("wb") as log_file:
                started.procs.append(
                    subprocess.Popen(
                        [
                            *(sys.executable, "-m", "radixserve.cli", "serve", name),
                            *("--nats-url", nats_url, "--subject-prefix", prefix),
                            *flags,
                        ],
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        asyncio.run(_wait_alive(nats_url, started, set(services)))
    except BaseException:
        started.stop()
        raise
    return started


async def _wait_alive(nats_url: str, started: Services, names: set[str]) -> None:
    """Until every service published its `ServiceHeartbeat` (sent once `main` returned)."""
    seen: set[str] = set()
    bus = await Bus.connect(BusSettings(url=nats_url, name="test-wait"))

    async def on_alive(msg: BusMsg) -> None:
        seen.add(decode(msg.data, ServiceHeartbeat).service)

    try:
        await bus.subscribe(started.subjects.alive_all, on_alive)
        deadline = time.monotonic() + START_TIMEOUT_S
        while seen != names:
            for proc in started.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"a service exited early:\n{started.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"services not up: {names - seen}\n{started.log_tail()}")
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(embedded_model_dir())


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def front(
    nats_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Services]:
    """tokenizer + grammar + scheduler under one fresh prefix, for the whole module."""
    started = _start(
        nats_url,
        tmp_path_factory.mktemp("front"),
        {
            "tokenizer": ["--model", str(model_dir), "--context-length", str(CONTEXT)],
            "grammar": [],
            "scheduler": ["--worker-timeout-s", "5"],
        },
    )
    try:
        yield started
    finally:
        started.stop()


# -- the test's gateway and workers ----------------------------------------------------------


class Inbox:
    """Decoded messages of one subscription, waited for with a timeout."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[BusMsg] = asyncio.Queue()

    async def handler(self, msg: BusMsg) -> None:
        self.messages.put_nowait(msg)

    async def next(self, type_: type[Any], timeout_s: float = WAIT_S) -> Any:
        msg = await asyncio.wait_for(self.messages.get(), timeout_s)
        return decode(msg.data, type_)

    async def next_msg(self, timeout_s: float = WAIT_S) -> BusMsg:
        return await asyncio.wait_for(self.messages.get(), timeout_s)


class FakeWorkers:
    """Workers as the scheduler sees them: heartbeats, one stats report, flush replies."""

    def __init__(
        self, bus: Bus, subjects: Subjects, loads: dict[str, int], *, listen: bool = True
    ) -> None:
        self.bus = bus
        self.listen = listen  # subscribed to the run subjects (else NATS has no responders)
        self.ack = True  # acknowledge each run on receipt, as the worker does
        self.subjects = subjects
        self.loads = loads
        self.status = WorkerStatus.READY
        self.flush_ok = True
        self.flushes: dict[str, list[str]] = {worker_id: [] for worker_id in loads}
        self.runs = Inbox()  # every worker's run subject
        self.aborts = Inbox()
        self._beating: asyncio.Task[None] | None = None
        self._run_sub: BusSubscription | None = None

    async def start(self) -> None:
        s = self.subjects
        if self.listen:
            self._run_sub = await self.bus.subscribe(s.worker_run_all, self._on_run)
        await self.bus.subscribe(s.worker_abort_all, self.aborts.handler)
        for worker_id in self.loads:
            await self.bus.subscribe(
                s.worker_flush_cache(worker_id), self._flush_handler(worker_id)
            )
        for worker_id, load in self.loads.items():
            stats = WorkerStats(
                worker_id=worker_id,
                time=time.time(),
                num_running_reqs=load,
                num_queue_reqs=0,
                free_kv_tokens=4096,
            )
            await self.bus.publish(s.stats(worker_id), encode(stats))
        self._beating = asyncio.create_task(self._beat_forever())
        await self.wait_routable()

    async def stop(self) -> None:
        """Say `stopping` (the scheduler routes nothing here any more), then go quiet."""
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        self.status = WorkerStatus.STOPPING
        await self._beat_once()
        if self._run_sub is not None:
            await self._run_sub.unsubscribe()
        await self.bus.nats_client.flush()

    async def wait_routable(self) -> None:
        """Until the scheduler counts every worker ready: a flush reaches all of them."""
        deadline = time.monotonic() + WAIT_S
        while True:
            reply = await self.flush(_id("probe"))
            if reply.ok and reply.message == f"flushed {len(self.loads)} worker(s)":
                return
            assert time.monotonic() < deadline, f"workers never routable: {reply}"
            await asyncio.sleep(0.1)

    async def flush(self, rid: str) -> FlushCacheReply:
        raw = await self.bus.request(
            self.subjects.flush_cache, encode(FlushCacheRequest(rid=rid)), timeout_s=WAIT_S
        )
        reply: FlushCacheReply = decode(raw.data, FlushCacheReply)
        return reply

    async def finish(self, worker_id: str, rid: str, gateway_id: str, index: int = 0) -> None:
        out = StepOutput(
            rid=rid, gateway_id=gateway_id, index=index, finish_reason=FinishReason(kind="stop")
        )
        batch = StepOutputBatch(worker_id=worker_id, step=1, outputs=[out])
        await self.bus.publish(self.subjects.detok, encode(batch))

    async def _on_run(self, msg: BusMsg) -> None:
        if self.ack:
            await self.bus.acknowledge(msg)
        await self.runs.handler(msg)

    def _flush_handler(self, worker_id: str) -> Any:
        async def on_flush(msg: BusMsg) -> None:
            request = decode(msg.data, FlushCacheRequest)
            self.flushes[worker_id].append(request.rid)
            reply = FlushCacheReply(
                rid=request.rid,
                ok=self.flush_ok,
                worker_id=worker_id,
                message="" if self.flush_ok else "busy",
            )
            await self.bus.respond(msg, encode(reply))

        return on_flush

    async def _beat_once(self) -> None:
        for worker_id in self.loads:
            beat = Heartbeat(
                worker_id=worker_id,
                time=time.time(),
                status=self.status,
                capacity=CAPACITY,
                epoch=1,
            )
            await self.bus.publish(self.subjects.heartbeat(worker_id), encode(beat))

    async def _beat_forever(self) -> None:
        while True:
            await self._beat_once()
            await asyncio.sleep(0.3)


class Gateway:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gateway_id = _id("gw")
        self.errors = Inbox()

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.gateway_errors(self.gateway_id), self.errors.handler)

    async def submit(self, rid: str | None = None, **fields: Any) -> str:
        rid = rid or _id("r")
        sampling = fields.pop("sampling", SamplingParams(max_new_tokens=16))
        req = SubmitRequest(rid=rid, gateway_id=self.gateway_id, sampling=sampling, **fields)
        await self.bus.publish(self.subjects.tokenize, encode(req))
        return rid

    async def error(self) -> RequestError:
        error: RequestError = await self.errors.next(RequestError)
        return error


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    client = await Bus.connect(BusSettings(url=nats_url, name="test-front"))
    yield client
    await client.close()


async def _gateway(bus: Bus, subjects: Subjects) -> Gateway:
    gateway = Gateway(bus, subjects)
    await gateway.start()
    return gateway


@contextlib.asynccontextmanager
async def _workers(
    bus: Bus, subjects: Subjects, loads: dict[str, int]
) -> AsyncIterator[FakeWorkers]:
    workers = FakeWorkers(bus, subjects, loads)
    await workers.start()
    try:
        yield workers
    finally:
        await workers.stop()


# -- the request path ----------------------------------------------------------------------------


async def test_prompts_are_tokenized_and_routed_to_the_least_loaded_worker(
    front: Services, bus: Bus, tokenizer: Any
) -> None:
    gateway = await _gateway(bus, front.subjects)
    busy, idle = _id("wbusy"), _id("widle")
    messages = [{"role": "user", "content": "What is 2 + 2? Réponds en français."}]
    text = "The quick brown fox jumps over the lazy dog"
    ids = [17, 4_000, 49_151]
    expected = {
        "text": tokenizer.encode(text),
        "messages": apply_chat_template(tokenizer, messages),
        "ids": ids,
    }
    async with _workers(bus, front.subjects, {busy: 50, idle: 0}) as workers:
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
    assert gateway.errors.messages.empty()


async def test_refusals_reach_the_gateway_with_code_and_param(
    front: Services, bus: Bus, tokenizer: Any
) -> None:
    gateway = await _gateway(bus, front.subjects)
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
    from radixserve.prep.prompt import tokenizer_id
    from radixserve.protocol import grammar_key

    gateway = await _gateway(bus, front.subjects)
    async with _workers(bus, front.subjects, {_id("w"): 0}) as workers:
        rid = await gateway.submit(text="Pick a digit:", sampling=SamplingParams(regex="[0-9]"))
        routed = decode((await workers.runs.next_msg(timeout_s=30)).data, RoutedRequest)
    assert routed.rid == rid
    assert routed.request.grammar_key == grammar_key("regex", "[0-9]", tokenizer_id(model_dir))
    assert routed.request.sampling.regex == "[0-9]"  # the worker can compile it itself

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
    gateway = await _gateway(bus, front.subjects)
    w0, w1 = _id("wa"), _id("wb")
    async with _workers(bus, front.subjects, {w0: 0, w1: 9}) as workers:
        rid = await gateway.submit(text="Tell me a long story")
        routed = await workers.runs.next(RoutedRequest)
        assert (routed.rid, routed.worker_id) == (rid, w0)
        await bus.publish(front.subjects.abort, encode(AbortRequest(rid=rid, reason="client left")))
        msg = await workers.aborts.next_msg()
        assert msg.subject == front.subjects.worker_abort(w0)
        assert decode(msg.data, AbortRequest) == AbortRequest(rid=rid, reason="client left")

        # The abort overtakes its request: the request is never routed; the next one is.
        early = _id("r")
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


async def test_flush_cache_fans_out_and_is_ok_only_when_all_are(front: Services, bus: Bus) -> None:
    w0, w1 = _id("wf"), _id("wg")
    async with _workers(bus, front.subjects, {w0: 0, w1: 0}) as workers:
        reply = await workers.flush("flush-1")
        assert (reply.rid, reply.ok) == ("flush-1", True)
        assert workers.flushes[w0][-1] == workers.flushes[w1][-1] == "flush-1"
        workers.flush_ok = False
        reply = await workers.flush("flush-2")
        assert not reply.ok
        assert f"{w0}: busy" in reply.message and f"{w1}: busy" in reply.message


# -- backpressure, on a scheduler of its own -------------------------------------------------------


async def test_scheduler_answers_503_without_workers_and_429_over_its_bound(
    nats_url: str, bus: Bus, tmp_path: Path
) -> None:
    flags = ["--max-pending-requests", "2", "--worker-timeout-s", "1", "--retry-after-s", "3"]
    scheduler = await asyncio.to_thread(_start, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await _gateway(bus, subjects)

        async def schedule(rid: str) -> None:
            req = TokenizedRequest(
                rid=rid, gateway_id=gateway.gateway_id, input_ids=pack_tokens([1, 2])
            )
            await bus.publish(subjects.schedule, encode(req))

        await schedule("r-none")
        error = await gateway.error()
        assert (error.rid, error.http_status, error.code, error.retry_after_s) == (
            "r-none",
            503,
            "no_worker",
            3.0,
        )

        worker = _id("w")
        workers = FakeWorkers(bus, subjects, {worker: 0})
        await workers.start()
        for rid in ("r1", "r2", "r3"):
            await schedule(rid)
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
        await schedule("r4")
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
    scheduler = await asyncio.to_thread(_start, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await _gateway(bus, subjects)
        worker = _id("w")
        async with _workers(bus, subjects, {worker: 0}) as workers:
            limit = bus.nats_client.max_payload

            def tokenized(rid: str, n: int) -> bytes:
                ids = pack_tokens([7] * n)
                req = TokenizedRequest(rid=rid, gateway_id=gateway.gateway_id, input_ids=ids)
                return encode(req)

            n = (limit - len(tokenized("r-big", 0))) // 4 - 2
            big = tokenized("r-big", n)
            assert limit - 16 < len(big) <= limit
            await bus.publish(subjects.schedule, big)
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-big", 413, "request_too_large")
            assert error.retry_after_s is None  # sending it again cannot succeed
            # Its place is free: with one place in all, the next request is routed.
            await bus.publish(subjects.schedule, tokenized("r-next", 2))
            assert (await workers.runs.next(RoutedRequest)).rid == "r-next"
    finally:
        scheduler.stop()


# -- acknowledged sends: a request nobody takes is answered, not left to the timeout ---------


async def test_the_tokenizer_and_the_scheduler_acknowledge_what_they_receive(
    front: Services, bus: Bus
) -> None:
    subjects = front.subjects
    gateway = await _gateway(bus, subjects)
    submit = SubmitRequest(
        rid=_id("r"), gateway_id=gateway.gateway_id, sampling=SamplingParams(), text="hi"
    )
    reply = await bus.request(subjects.tokenize, encode(submit), timeout_s=WAIT_S)
    assert reply.data == b""
    tokenized = TokenizedRequest(
        rid=_id("r"), gateway_id=gateway.gateway_id, input_ids=pack_tokens([1, 2])
    )
    reply = await bus.request(subjects.schedule, encode(tokenized), timeout_s=WAIT_S)
    assert reply.data == b""


async def test_the_tokenizer_answers_503_when_no_scheduler_takes_the_request(
    nats_url: str, bus: Bus, model_dir: Path, tmp_path: Path
) -> None:
    flags = ["--model", str(model_dir), "--context-length", str(CONTEXT)]
    flags += ["--schedule-ack-timeout-s", "0.5"]
    tokenizer = await asyncio.to_thread(_start, nats_url, tmp_path, {"tokenizer": flags})
    try:
        subjects = tokenizer.subjects
        gateway = await _gateway(bus, subjects)
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
    scheduler = await asyncio.to_thread(_start, nats_url, tmp_path, {"scheduler": flags})
    try:
        subjects = scheduler.subjects
        gateway = await _gateway(bus, subjects)

        async def schedule(rid: str) -> None:
            req = TokenizedRequest(
                rid=rid, gateway_id=gateway.gateway_id, input_ids=pack_tokens([1, 2])
            )
            await bus.publish(subjects.schedule, encode(req))

        worker = _id("w")
        async with _workers(bus, subjects, {worker: 0}) as workers:
            # It takes the run but never acknowledges (as if the message were lost).
            workers.ack = False
            await schedule("r-silent")
            assert (await workers.runs.next(RoutedRequest)).rid == "r-silent"
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-silent", 503, "worker_lost")
            assert "did not acknowledge the request within 0.5 s" in error.message
            abort = await workers.aborts.next(AbortRequest)
            assert (abort.rid, abort.reason) == ("r-silent", "not_acknowledged")
            # An acknowledged run stays in flight past the ack timeout.
            workers.ack = True
            await schedule("r-ok")
            assert (await workers.runs.next(RoutedRequest)).rid == "r-ok"
            await asyncio.sleep(1.5)
            assert gateway.errors.messages.empty()
            await workers.finish(worker, "r-ok", gateway.gateway_id)
        # A worker that heartbeats but does not listen for runs: NATS says so at once.
        deaf = FakeWorkers(bus, subjects, {_id("w"): 0}, listen=False)
        await deaf.start()
        try:
            await schedule("r-deaf")
            error = await gateway.error()
            assert (error.rid, error.http_status, error.code) == ("r-deaf", 503, "worker_lost")
            assert "does not listen for requests" in error.message
        finally:
            await deaf.stop()
    finally:
        scheduler.stop()
