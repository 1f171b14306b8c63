"""`radixserve serve detokenizer` as a real subprocess on a real NATS: step batches of two
gateways in, one TextDeltaBatch per gateway per step out, text equal to the reference."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from radixserve.bus import Bus, BusMsg, BusSettings
from radixserve.protocol import (
    AbortRequest,
    DetokParams,
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


@pytest.fixture
def service(nats_url: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "detokenizer.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
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
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
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


async def test_a_stream_missing_tokens_is_failed_and_aborted_not_finished_with_a_hole(
    nats_url: str, tokenizer: Any, service: tuple[str, subprocess.Popen[bytes], Path]
) -> None:
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
        assert errors.empty() and aborts.empty() and finished.empty()
    finally:
        await bus.close()
