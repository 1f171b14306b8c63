"""`radixserve serve detokenizer` as a real subprocess on a real NATS: step batches of two
gateways in, one TextDeltaBatch per gateway per step out, text equal to the reference;
SIGKILLed and restarted mid-way, it rebuilds every stream from the worker's history."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.api import Assembly, CompletionRequest, parse_body, plan_completion
from radixserve.bus import Bus, BusMsg, BusSettings
from radixserve.protocol import (
    AbortRequest,
    DetokParams,
    DetokResync,
    FinishReason,
    RequestError,
    ServiceHeartbeat,
    StepOutput,
    StepOutputBatch,
    Subjects,
    TextDeltaBatch,
    TopLogprobs,
    decode,
    encode,
    pack_tokens,
)
from tests.helpers.tiny_models import embedded_model_dir

pytestmark = pytest.mark.timeout(90)

START_TIMEOUT_S = 45.0
WAIT_S = 10.0
LENGTH = FinishReason(kind="length")


@dataclass
class Stream:
    """One request choice as a worker would report it: its ids arrive one per step."""

    rid: str
    gateway_id: str
    ids: list[int]
    params: DetokParams
    index: int = 0
    logprobs: bool = False
    finish: FinishReason = LENGTH

    def output(self, step: int) -> StepOutput | None:
        if step >= len(self.ids):
            return None
        token_id = self.ids[step]
        last = step == len(self.ids) - 1
        return StepOutput(
            rid=self.rid,
            gateway_id=self.gateway_id,
            index=self.index,
            new_token_ids=pack_tokens([token_id]),
            finish_reason=self.finish if last else None,
            prompt_tokens=5,
            completion_tokens=step + 1,
            token_logprobs=[-0.25] if self.logprobs else None,
            top_logprobs=(
                [TopLogprobs(token_ids=pack_tokens([token_id]), logprobs=[-0.25])]
                if self.logprobs
                else None
            ),
            detok=self.params if step == 0 else None,
        )


async def detokenizer_alive(bus: Bus, subjects: Subjects) -> None:
    """Until the service's first heartbeat: sent once its tokenizer is loaded and it
    subscribed."""
    alive = asyncio.Event()

    async def on_alive(msg: BusMsg) -> None:
        if decode(msg.data, ServiceHeartbeat).service == "detokenizer":
            alive.set()

    subscription = await bus.subscribe(subjects.alive_all, on_alive)
    await asyncio.wait_for(alive.wait(), START_TIMEOUT_S)
    await subscription.unsubscribe()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model_files.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_dir())


def start_service(nats_url: str, prefix: str, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.cli",
                "serve",
                "detokenizer",
                "--nats-url",
                nats_url,
                "--subject-prefix",
                prefix,
                "--model",
                str(embedded_model_dir()),
                "--max-requests",
                "64",
                "--output-log-ttl-s",
                "0",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def service(nats_url: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "detokenizer.log"
    proc = start_service(nats_url, prefix, log_path)
    try:
        yield prefix, proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def test_two_gateways_get_their_text(
    nats_url: str, tokenizer: Any, service: tuple[str, subprocess.Popen[bytes], Path]
) -> None:
    prefix, proc, log_path = service
    subjects = Subjects(prefix)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    streams = [
        Stream("a1", "gwA", tokenizer.encode("Héllo 😀 wörld 你好, naïve café"), DetokParams()),
        Stream(
            "a2",
            "gwA",
            tokenizer.encode("Stop here: the end is near<|im_end|> and more"),
            DetokParams(skip_special_tokens=False, stop=["end is"]),
            logprobs=True,
        ),
        Stream("b1", "gwB", [*tokenizer.encode("日本語 🎉 ok"), eos], DetokParams(), index=0),
        Stream("b1", "gwB", tokenizer.encode("Ünïcödé 👍🏽 done"), DetokParams(), index=1),
    ]
    a2 = streams[1]
    # As the engine would: a2 finishes on the token that completes its stop string.
    upto = next(n for n in range(len(a2.ids)) if "end is" in tokenizer.decode(a2.ids[: n + 1]))
    a2.ids, a2.finish = a2.ids[: upto + 1], FinishReason(kind="stop", matched="end is")
    streams[2].finish = FinishReason(kind="stop", matched=eos)
    expected = {
        ("a1", 0): "Héllo 😀 wörld 你好, naïve café",
        ("a2", 0): "Stop here: the ",
        ("b1", 0): "日本語 🎉 ok",
        ("b1", 1): "Ünïcödé 👍🏽 done",
    }

    bus = await Bus.connect(BusSettings(url=nats_url, name="test-detok"))
    batches: dict[str, list[TextDeltaBatch]] = defaultdict(list)
    try:

        def collector(gateway_id: str) -> Any:
            async def on_deltas(msg: BusMsg) -> None:
                batches[gateway_id].append(decode(msg.data, TextDeltaBatch))

            return on_deltas

        for gateway_id in ("gwA", "gwB"):
            await bus.subscribe(subjects.gateway_deltas(gateway_id), collector(gateway_id))
        # The first heartbeat comes after the tokenizer is loaded and the subscription made.
        await detokenizer_alive(bus, subjects)

        num_steps = max(len(s.ids) for s in streams)
        steps_with: dict[str, int] = defaultdict(int)
        for step in range(num_steps):
            outputs = [out for s in streams if (out := s.output(step)) is not None]
            for gateway_id in {out.gateway_id for out in outputs}:
                steps_with[gateway_id] += 1
            # Step numbers skip one before the last batch: the service logs the gap.
            number = step if step < num_steps - 1 else step + 1
            batch = StepOutputBatch(worker_id="w0", step=number, outputs=outputs)
            await bus.publish(subjects.detok, encode(batch))

        def finished() -> int:
            return sum(
                1
                for gateway_batches in batches.values()
                for batch in gateway_batches
                for delta in batch.deltas
                if delta.finish_reason is not None
            )

        async def all_finished() -> None:
            while finished() < len(streams):
                await asyncio.sleep(0.02)

        await asyncio.wait_for(all_finished(), WAIT_S)
        await bus.nats_client.flush(timeout=2)  # type: ignore[arg-type]
        await asyncio.sleep(0.2)  # nothing more may come

        assert {g: len(b) for g, b in batches.items()} == dict(steps_with)
        texts: dict[tuple[str, int], str] = defaultdict(str)
        ids: dict[tuple[str, int], list[int]] = defaultdict(list)
        for gateway_id, gateway_batches in batches.items():
            for batch in gateway_batches:
                assert batch.gateway_id == gateway_id
                keys = [(d.rid, d.index) for d in batch.deltas]
                assert len(keys) == len(set(keys)), "one delta per stream per step"
                for delta in batch.deltas:
                    assert "\ufffd" not in delta.text
                    texts[(delta.rid, delta.index)] += delta.text
                    ids[(delta.rid, delta.index)] += delta.token_ids_list
                    if delta.rid == "a2":
                        assert delta.logprobs is not None
                        assert [e.token for e in delta.logprobs] == [
                            tokenizer.decode(delta.token_ids_list)
                        ]
        assert dict(texts) == expected
        assert {key: ids[key] for key in expected} == {(s.rid, s.index): s.ids for s in streams}
        assert {d.rid for b in batches["gwA"] for d in b.deltas} == {"a1", "a2"}
        assert {d.rid for b in batches["gwB"] for d in b.deltas} == {"b1"}
    finally:
        await bus.close()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    log = log_path.read_text()
    assert "1 step batch(es) missing before step" in log
    assert "drained with 0 unfinished streams" in log, log


async def test_a_stream_missing_tokens_no_worker_resends_is_failed_and_aborted(
    nats_url: str, tokenizer: Any, service: tuple[str, subprocess.Popen[bytes], Path]
) -> None:
    # Its history is asked for; no worker answers (none runs here): failed, not finished
    # with a hole, once the wait ends.
    prefix, _, _ = service
    subjects = Subjects(prefix)
    ids = tokenizer.encode("one two three four")
    bus = await Bus.connect(BusSettings(url=nats_url, name="test-detok-lost"))
    errors: asyncio.Queue[RequestError] = asyncio.Queue()
    aborts: asyncio.Queue[AbortRequest] = asyncio.Queue()
    texts: dict[str, str] = defaultdict(str)
    finished: asyncio.Queue[str] = asyncio.Queue()
    try:

        async def on_error(msg: BusMsg) -> None:
            errors.put_nowait(decode(msg.data, RequestError))

        async def on_abort(msg: BusMsg) -> None:
            aborts.put_nowait(decode(msg.data, AbortRequest))

        async def on_deltas(msg: BusMsg) -> None:
            for delta in decode(msg.data, TextDeltaBatch).deltas:
                texts[delta.rid] += delta.text
                if delta.finish_reason is not None:
                    finished.put_nowait(delta.rid)

        resyncs: asyncio.Queue[DetokResync] = asyncio.Queue()

        async def on_resync(msg: BusMsg) -> None:
            resync = decode(msg.data, DetokResync)
            if resync.rids:  # (not its ask for everything on start)
                resyncs.put_nowait(resync)

        await bus.subscribe(subjects.detok_resync, on_resync)
        await bus.subscribe(subjects.gateway_errors("gw"), on_error)
        await bus.subscribe(subjects.abort, on_abort, queue="scheduler")
        await bus.subscribe(subjects.gateway_deltas("gw"), on_deltas)
        await detokenizer_alive(bus, subjects)

        def out(rid: str, lo: int, hi: int, finish: FinishReason | None = None) -> StepOutput:
            return StepOutput(
                rid=rid,
                gateway_id="gw",
                new_token_ids=pack_tokens(ids[lo:hi]),
                finish_reason=finish,
                completion_tokens=hi,
                detok=DetokParams() if lo == 0 else None,
            )

        steps = [
            [out("lost", 0, 1), out("whole", 0, 1)],
            [out("whole", 1, 2)],  # "lost"'s second token is in a batch that never comes
            [out("lost", 2, 3), out("whole", 2, len(ids), LENGTH)],
            [out("lost", 3, len(ids), LENGTH)],
        ]
        for number, outputs in enumerate(steps):
            batch = StepOutputBatch(worker_id="w0", step=number, outputs=outputs)
            await bus.publish(subjects.detok, encode(batch))

        asked = await asyncio.wait_for(resyncs.get(), WAIT_S)
        assert asked.rids == ["lost"]
        error = await asyncio.wait_for(errors.get(), WAIT_S)
        assert (error.rid, error.http_status, error.code) == ("lost", 503, "output_lost")
        assert error.retry_after_s == 1.0
        abort = await asyncio.wait_for(aborts.get(), WAIT_S)
        assert (abort.rid, abort.reason) == ("lost", "output_lost")
        assert await asyncio.wait_for(finished.get(), WAIT_S) == "whole"
        await bus.nats_client.flush(timeout=2)  # type: ignore[arg-type]
        await asyncio.sleep(0.2)  # nothing more may come
        assert texts["whole"] == tokenizer.decode(ids)
        assert texts["lost"] == tokenizer.decode(ids[:1])  # before the hole, nothing after
        assert errors.empty() and aborts.empty() and finished.empty() and resyncs.empty()
    finally:
        await bus.close()


class FakeWorker:
    """Publishes its streams' steps as a worker would, and answers a `DetokResync` with
    each asked stream's whole output so far (finished ones too) in `resent`; one for
    every request only `late` steps after it came (so outputs met mid-way come first)."""

    def __init__(self, bus: Bus, subjects: Subjects, streams: list[Stream], late: int) -> None:
        self.bus, self.subjects, self.streams = bus, subjects, streams
        self.late = late
        self.step = 0  # steps published
        self.number = 0  # batches published
        self.lock = asyncio.Lock()  # a history follows every step published before it
        self.answered: list[list[str]] = []
        self._answer_all_at: int | None = None

    async def publish_step(self) -> None:
        async with self.lock:
            outputs = [out for s in self.streams if (out := s.output(self.step)) is not None]
            self.step += 1
            await self._publish(StepOutputBatch(worker_id="w0", step=0, outputs=outputs))
            if self._answer_all_at is not None and self.step >= self._answer_all_at:
                self._answer_all_at = None
                await self._answer([])

    async def on_resync(self, msg: BusMsg) -> None:
        asked = decode(msg.data, DetokResync).rids
        async with self.lock:
            if not asked and self.late:
                self._answer_all_at = self.step + self.late
            else:
                await self._answer(asked)

    async def _answer(self, asked: list[str]) -> None:
        resent = [
            self._history(s) for s in self.streams if (not asked or s.rid in asked) and self.step
        ]
        self.answered.append(asked)
        if resent:
            await self._publish(StepOutputBatch(worker_id="w0", step=0, resent=resent))

    def _history(self, stream: Stream) -> StepOutput:
        sent = min(self.step, len(stream.ids))
        return StepOutput(
            rid=stream.rid,
            gateway_id=stream.gateway_id,
            index=stream.index,
            new_token_ids=pack_tokens(stream.ids[:sent]),
            finish_reason=stream.finish if sent == len(stream.ids) else None,
            prompt_tokens=5,
            completion_tokens=sent,
            detok=stream.params,
        )

    async def _publish(self, batch: StepOutputBatch) -> None:
        self.number += 1
        numbered = msgspec.structs.replace(batch, step=self.number)
        await self.bus.publish(self.subjects.detok, encode(numbered))


def completion_plan(n: int = 1) -> Any:
    body = {"model": "m", "prompt": "x", "n": n, "max_tokens": 500, "stream": True}
    return plan_completion(
        parse_body(CompletionRequest, json.dumps(body).encode()),
        response_id=f"resp-{uuid.uuid4().hex[:8]}",
        gateway_id="gw",
        served_model="m",
        arrival_time=0.0,
    )


@pytest.mark.parametrize("late", [0, 2])
async def test_a_restarted_detokenizer_continues_every_stream_from_the_workers_history(
    nats_url: str,
    tokenizer: Any,
    service: tuple[str, subprocess.Popen[bytes], Path],
    late: int,
) -> None:
    """SIGKILL mid-way, steps lost while it is down, a new one started: each stream (one
    finished while it was away, one with n = 2) ends with the uninterrupted text, each
    token once, as the gateway's assembly puts it together. The history comes for its
    ask for every request on start, or (`late`) first for the requests it meets mid-way."""
    prefix, proc, log_path = service
    subjects = Subjects(prefix)
    texts = ["Héllo 😀 wörld 你好, naïve café 🎉👍🏽", "short one", "日本語のテキスト 🇫🇷 ok"]
    plans = [completion_plan(), completion_plan(), completion_plan(n=2)]
    streams = [
        Stream(plans[0].rids[0], "gw", tokenizer.encode(texts[0]), DetokParams()),
        Stream(plans[1].rids[0], "gw", tokenizer.encode(texts[1]), DetokParams()),
        Stream(plans[2].rids[0], "gw", tokenizer.encode(texts[2]), DetokParams(), index=0),
        Stream(plans[2].rids[0], "gw", tokenizer.encode(texts[0]), DetokParams(), index=1),
    ]
    assert len(streams[1].ids) < 8  # finishes while the detokenizer is away
    assemblies = {plan.rids[0]: Assembly(plan) for plan in plans}
    shown: dict[tuple[str, int], str] = defaultdict(str)  # what each client is sent
    rebuilt: set[tuple[str, int]] = set()
    bus = await Bus.connect(BusSettings(url=nats_url, name="test-detok-restart"))
    try:

        async def on_deltas(msg: BusMsg) -> None:
            for delta in decode(msg.data, TextDeltaBatch).deltas:
                rebuilt.update([(delta.rid, delta.index)] if delta.resent else [])
                update = assemblies[delta.rid].apply(delta)
                if update is not None:
                    shown[delta.rid, delta.index] += update.delta.text

        worker = FakeWorker(bus, subjects, streams, late)
        await bus.subscribe(subjects.gateway_deltas("gw"), on_deltas)
        await bus.subscribe(subjects.detok_resync, worker.on_resync)
        await detokenizer_alive(bus, subjects)
        for _ in range(4):
            await worker.publish_step()
        await bus.nats_client.flush(timeout=2)  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # decoded and sent before the kill
        proc.kill()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        worker.answered.clear()
        for _ in range(4):  # nobody decodes these
            await worker.publish_step()
        restarted = start_service(nats_url, prefix, log_path)
        try:
            await detokenizer_alive(bus, subjects)
            while worker.step < max(len(s.ids) for s in streams) + 1:
                await worker.publish_step()
                await asyncio.sleep(0.01)

            async def all_done() -> None:
                while not all(a.done for a in assemblies.values()):
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(all_done(), WAIT_S)
        finally:
            restarted.send_signal(signal.SIGTERM)
            assert restarted.wait(timeout=20) == 0
    finally:
        await bus.close()
    assert [] in worker.answered  # the new one asked for everything on start
    if late:  # and for the requests it met mid-way, before that answer
        assert sorted(worker.answered[0]) == sorted({s.rid for s in streams} - {streams[1].rid})
    assert rebuilt == {(s.rid, s.index) for s in streams}
    for stream in streams:
        key = (stream.rid, stream.index)
        assert shown[key] == tokenizer.decode(stream.ids), key
        choice = assemblies[stream.rid].choices[stream.index]
        assert choice.token_ids == stream.ids and choice.finish == LENGTH
    for plan in plans:
        usage = assemblies[plan.rids[0]].usage()
        assert usage.completion_tokens == sum(len(s.ids) for s in streams if s.rid in plan.rids)
    assert "output_lost" not in log_path.read_text()
