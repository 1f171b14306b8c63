"""The worker service on a real NATS: the test plays scheduler and detokenizer.

Outputs must equal the in-process Engine's on the same weights; an abort frees the
request's KV (read back from WorkerStats); flush_cache answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from radixserve import Engine, protocol
from radixserve.bus import Bus, BusMsg
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("worker_model"), seed=0)


def worker_argv(
    nats_url: str, prefix: str, worker_id: str, model_dir: Path, *extra: str
) -> list[str]:
    """`radixserve serve worker` on the CPU with a 4096-token pool, plus `extra` flags."""
    return [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "worker",
        "--nats-url",
        nats_url,
        "--subject-prefix",
        prefix,
        "--instance-id",
        worker_id,
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        *extra,
    ]


@pytest.fixture(scope="module")
def worker(nats_url: str, model_dir: Path) -> Iterator[tuple[str, str]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    worker_id = "w-test"
    proc = subprocess.Popen(worker_argv(nats_url, prefix, worker_id, model_dir))
    try:
        yield prefix, worker_id
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=30) == 0, "the worker did not drain cleanly on SIGTERM"
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@contextlib.asynccontextmanager
async def _bus(nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_url)
    try:
        yield bus
    finally:
        await bus.close()


async def _wait_ready(bus: Bus, subjects: protocol.Subjects, worker_id: str) -> None:
    ready = asyncio.Event()

    async def on_beat(msg: BusMsg) -> None:
        beat = protocol.decode(msg.data, protocol.Heartbeat)
        if beat.worker_id == worker_id and beat.status is protocol.WorkerStatus.READY:
            ready.set()

    sub = await bus.subscribe(subjects.heartbeat(worker_id), on_beat)
    try:
        await asyncio.wait_for(ready.wait(), 90)
    finally:
        await sub.unsubscribe()


def _routed(rid: str, ids: list[int], worker_id: str, **sampling: object) -> bytes:
    request = protocol.TokenizedRequest(
        rid=rid,
        gateway_id="gw",
        input_ids=protocol.pack_tokens(ids),
        sampling=protocol.SamplingParams(**sampling),  # type: ignore[arg-type]
    )
    return protocol.encode(protocol.RoutedRequest(request=request, worker_id=worker_id))


async def test_outputs_equal_the_in_process_engine(
    nats_url: str, worker: tuple[str, str], model_dir: Path
) -> None:
    prefix, worker_id = worker
    subjects = protocol.Subjects(prefix)
    engine = Engine(model_path=str(model_dir), device="cpu")
    prompts = make_prompts(engine.runner.vocab_size, [5, 30, 12, 64, 8, 21], seed=1)
    reference = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0}
    )
    assert isinstance(reference, list)
    tokens: dict[str, list[int]] = defaultdict(list)
    finished: dict[str, protocol.StepOutput] = {}
    per_step_counts: list[int] = []
    done = asyncio.Event()

    async with _bus(nats_url) as bus:

        async def on_detok(msg: BusMsg) -> None:
            batch = protocol.decode(msg.data, protocol.StepOutputBatch)
            assert batch.worker_id == worker_id
            per_step_counts.append(len(batch.outputs))
            for out in batch.outputs:
                tokens[out.rid] += out.new_token_ids_list
                if out.finish_reason is not None:
                    finished[out.rid] = out
            if len(finished) == len(prompts):
                done.set()

        await bus.subscribe(subjects.detok, on_detok)
        await _wait_ready(bus, subjects, worker_id)
        for i, ids in enumerate(prompts):
            await bus.publish(
                subjects.worker_run(worker_id),
                _routed(f"r{i}", ids, worker_id, max_new_tokens=12, temperature=0.0),
            )
        await asyncio.wait_for(done.wait(), 60)
    for i, ref in enumerate(reference):
        assert tokens[f"r{i}"] == ref["output_ids"]
        final = finished[f"r{i}"]
        assert final.completion_tokens == 12 and final.prompt_tokens == len(prompts[i])
        assert final.finish_reason is not None and final.finish_reason.kind == "length"
    # One message per step carries many requests: never one message per token.
    assert max(per_step_counts) > 1


async def test_abort_frees_kv_and_flush_answers(nats_url: str, worker: tuple[str, str]) -> None:
    prefix, worker_id = worker
    subjects = protocol.Subjects(prefix)
    stats: list[protocol.WorkerStats] = []
    finals: dict[str, protocol.StepOutput] = {}
    first_token = asyncio.Event()

    async with _bus(nats_url) as bus:

        async def on_detok(msg: BusMsg) -> None:
            for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                if out.rid == "long":
                    first_token.set()
                    if out.finish_reason is not None:
                        finals[out.rid] = out

        async def on_stats(msg: BusMsg) -> None:
            stats.append(protocol.decode(msg.data, protocol.WorkerStats))

        await bus.subscribe(subjects.detok, on_detok)
        await bus.subscribe(subjects.stats(worker_id), on_stats)
        await _wait_ready(bus, subjects, worker_id)
        ids = list(range(300, 400))
        # Sent as the scheduler does, with a reply subject: the worker acknowledges it.
        ack = await bus.request(
            subjects.worker_run(worker_id),
            _routed("long", ids, worker_id, max_new_tokens=2000, ignore_eos=True),
            timeout_s=10,
        )
        assert ack.data == b""
        await asyncio.wait_for(first_token.wait(), 30)
        aborted_at = asyncio.get_running_loop().time()
        await bus.publish(
            subjects.worker_abort(worker_id), protocol.encode(protocol.AbortRequest(rid="long"))
        )
        while "long" not in finals:
            await asyncio.sleep(0.01)
            assert asyncio.get_running_loop().time() - aborted_at < 1.0, "abort took over 1 s"
        final = finals["long"]
        assert final.finish_reason is not None and final.finish_reason.kind == "abort"
        # The next stats report shows nothing running and every slot free or cached.
        seen = len(stats)
        while len(stats) <= seen:
            await asyncio.sleep(0.05)
        last = stats[-1]
        assert last.num_running_reqs == 0
        assert last.free_kv_tokens + last.evictable_kv_tokens == last.total_kv_tokens
        reply = await bus.request(
            subjects.worker_flush_cache(worker_id),
            protocol.encode(protocol.FlushCacheRequest(rid="f1")),
            timeout_s=10,
        )
        flushed = protocol.decode(reply.data, protocol.FlushCacheReply)
        assert flushed.ok and flushed.worker_id == worker_id


async def test_kv_events_mirror_the_cache_and_a_snapshot_resyncs(
    nats_url: str, worker: tuple[str, str]
) -> None:
    """A mirror built as the scheduler builds it: a snapshot first (the worker has served
    other tests), then numbered batches with no gap; a prompt's whole blocks appear once it
    ran, the heartbeat reports the last batch's number, and a flush clears the mirror."""
    from tests.unit.test_kv_block_events import replay

    prefix, worker_id = worker
    subjects = protocol.Subjects(prefix)
    batches: list[protocol.KvEventBatch] = []
    beats: list[protocol.Heartbeat] = []
    finished = asyncio.Event()

    async with _bus(nats_url) as bus:

        async def on_events(msg: BusMsg) -> None:
            batches.append(protocol.decode(msg.data, protocol.KvEventBatch))

        async def on_beat(msg: BusMsg) -> None:
            beats.append(protocol.decode(msg.data, protocol.Heartbeat))

        async def on_detok(msg: BusMsg) -> None:
            for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                if out.rid == "kv-ev" and out.finish_reason is not None:
                    finished.set()

        await bus.subscribe(subjects.kv_events(worker_id), on_events)
        await bus.subscribe(subjects.heartbeat(worker_id), on_beat)
        await bus.subscribe(subjects.detok, on_detok)
        await _wait_ready(bus, subjects, worker_id)
        await bus.publish(
            subjects.worker_kv_snapshot(worker_id),
            protocol.encode(protocol.KvSnapshotRequest(worker_id=worker_id, reason="test")),
        )

        async def until(check: object, what: str) -> None:
            for _ in range(400):
                if check():  # type: ignore[operator]
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"timed out waiting for {what}")

        await until(
            lambda: beats and any(b.events[:1] == [protocol.AllBlocksCleared()] for b in batches),
            "the snapshot",
        )
        block = beats[-1].capacity.kv_block_size
        assert block == 16
        start = next(
            i for i, b in enumerate(batches) if b.events[:1] == [protocol.AllBlocksCleared()]
        )
        prompt = list(range(500, 500 + 3 * block + 7))
        await bus.publish(
            subjects.worker_run(worker_id),
            _routed("kv-ev", prompt, worker_id, max_new_tokens=3, temperature=0.0),
        )
        await asyncio.wait_for(finished.wait(), 60)
        expected = set(protocol.block_hashes(prompt, block))
        mirror: set[int] = set()

        def caught_up() -> bool:
            mirror.clear()
            for batch in batches[start:]:
                replay(mirror, batch.events)
            return expected <= mirror

        await until(caught_up, "the prompt's blocks")
        seqs = [b.seq for b in batches[start:]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered, no gap
        assert {b.epoch for b in batches} == {beats[-1].epoch}
        await until(lambda: beats[-1].kv_event_seq == batches[-1].seq, "the heartbeat's seq")
        reply = await bus.request(
            subjects.worker_flush_cache(worker_id),
            protocol.encode(protocol.FlushCacheRequest(rid="kv-f")),
            timeout_s=10,
        )
        assert protocol.decode(reply.data, protocol.FlushCacheReply).ok
        await until(lambda: batches[-1].events == [protocol.AllBlocksCleared()], "the clear")


async def test_an_abort_right_behind_a_constrained_run_is_answered(
    nats_url: str, worker: tuple[str, str]
) -> None:
    # The run waits for its grammar in a task; the abort, sent in the same flush, may
    # cancel that task before it ever ran: the abort must still end the request.
    prefix, worker_id = worker
    subjects = protocol.Subjects(prefix)
    finals: dict[str, protocol.StepOutput] = {}

    async with _bus(nats_url) as bus:

        async def on_detok(msg: BusMsg) -> None:
            for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                if out.finish_reason is not None:
                    finals[out.rid] = out

        await bus.subscribe(subjects.detok, on_detok)
        await _wait_ready(bus, subjects, worker_id)
        schema = '{"type": "object"}'
        for i in range(3):
            rid = f"gone-{i}"
            request = protocol.TokenizedRequest(
                rid=rid,
                gateway_id="gw",
                input_ids=protocol.pack_tokens([5, 6, 7]),
                sampling=protocol.SamplingParams(json_schema=schema, max_new_tokens=8),
                grammar_key=protocol.grammar_key("json_schema", schema, f"tok-{i}"),
            )
            routed = protocol.RoutedRequest(request=request, worker_id=worker_id)
            await bus.publish(subjects.worker_run(worker_id), protocol.encode(routed))
            await bus.publish(
                subjects.worker_abort(worker_id), protocol.encode(protocol.AbortRequest(rid=rid))
            )
        await bus.nats_client.flush()
        async with asyncio.timeout(10):
            while len(finals) < 3:
                await asyncio.sleep(0.02)
        for i in range(3):
            reason = finals[f"gone-{i}"].finish_reason
            assert reason is not None and reason.kind == "abort"


async def test_sigterm_mid_request_ends_it_with_a_final_output_and_exits_0(
    nats_url: str, model_dir: Path
) -> None:
    # Its own worker: a request that would run for minutes is running at SIGTERM; the
    # drain aborts it within the drain budget (10 s), its final output goes out, exit 0.
    # A run sent while it drains is refused in its acknowledgement (the scheduler then
    # re-routes it), and never started.
    prefix, worker_id = f"t{uuid.uuid4().hex[:8]}", "w-drain"
    subjects = protocol.Subjects(prefix)
    finals: dict[str, protocol.StepOutput] = {}
    started = asyncio.Event()
    draining = asyncio.Event()
    seen: set[str] = set()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "radixserve.cli", "serve", "worker"),
            *("--nats-url", nats_url, "--subject-prefix", prefix),
            *("--instance-id", worker_id, "--model", str(model_dir)),
            *("--device", "cpu", "--max-total-tokens", "4096"),
        ],
    )
    try:
        async with _bus(nats_url) as bus:

            async def on_detok(msg: BusMsg) -> None:
                for out in protocol.decode(msg.data, protocol.StepOutputBatch).outputs:
                    started.set()
                    seen.add(out.rid)
                    if out.finish_reason is not None:
                        finals[out.rid] = out

            async def on_beat(msg: BusMsg) -> None:
                beat = protocol.decode(msg.data, protocol.Heartbeat)
                if beat.status is protocol.WorkerStatus.DRAINING:
                    draining.set()

            await bus.subscribe(subjects.detok, on_detok)
            await bus.subscribe(subjects.heartbeat(worker_id), on_beat)
            await _wait_ready(bus, subjects, worker_id)
            await bus.publish(
                subjects.worker_run(worker_id),
                _routed(
                    "endless", list(range(300, 340)), worker_id, max_new_tokens=400, ignore_eos=True
                ),
            )
            await asyncio.wait_for(started.wait(), 30)
            proc.terminate()
            await asyncio.wait_for(draining.wait(), 10)
            ack = await bus.request(
                subjects.worker_run(worker_id),
                _routed("late", list(range(300, 310)), worker_id, max_new_tokens=4),
                timeout_s=10,
            )
            assert ack.headers.get(protocol.RUN_REFUSED_HEADER) == "draining"
            code = await asyncio.to_thread(proc.wait, 20)
            assert code == 0
            await bus.nats_client.flush()
            final = finals["endless"].finish_reason
            assert final is not None and final.kind in ("abort", "length")
            assert "late" not in seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def test_bad_parameters_are_rejected_to_the_gateway(
    nats_url: str, worker: tuple[str, str]
) -> None:
    prefix, worker_id = worker
    subjects = protocol.Subjects(prefix)
    errors: list[protocol.RequestError] = []
    async with _bus(nats_url) as bus:

        async def on_error(msg: BusMsg) -> None:
            errors.append(protocol.decode(msg.data, protocol.RequestError))

        await bus.subscribe(subjects.gateway_errors("gw"), on_error)
        await _wait_ready(bus, subjects, worker_id)
        await bus.publish(
            subjects.worker_run(worker_id), _routed("bad", [1, 2, 3], worker_id, top_p=7.0)
        )
        for _ in range(200):
            if errors:
                break
            await asyncio.sleep(0.02)
    assert errors and errors[0].rid == "bad"
    assert errors[0].http_status == 400 and errors[0].param == "top_p"
