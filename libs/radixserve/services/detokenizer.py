"""radixserve serve detokenizer: step batches of token ids in, text deltas out.

Subscribes `{p}.detok` (no queue group: one instance keeps every request's decoding
state, and a second would send every delta twice), turns each worker's `StepOutputBatch`
into text with `radixserve.detok`, and publishes one `TextDeltaBatch` per gateway on
`{p}.gateway.{gateway_id}.deltas`. The tokenizer is loaded before subscribing, so nothing
arrives before it can be decoded. At most `--max-requests` live streams are kept (the
oldest dropped), so a lost finish cannot leak memory. A skipped step number of a worker
is logged. Its state is reconstructible: a request met mid-way or whose token counts show
a hole (a restart, a lost batch, an evicted state) is asked of the workers on
`{p}.detok_resync`, and the worker holding it sends its whole output so far (or its final
one, if it finished in the last 30 s) in the next batch's `resent`, decoded from the
start; its deltas carry offsets, so the gateway skips what it already has. On start it
asks for every request, for those that finished while it was away. Without an answer in
`RESYNC_TIMEOUT_S`, the request gets 503 `output_lost` and an abort on `{p}.abort`
instead of text with a hole. On SIGTERM it decodes and publishes what is queued, flushes
and exits.

The deltas of resumable requests (DetokParams.resumable: streams, and `X-Resumable`
requests) also go, numbered, to the store's output log (store/output_log.py), where a
gateway reads them when a client resumes; for `--output-log-ttl-s` after the last one.
Redis being slow or down delays no delta: the log then misses entries (counted), and a
resume of those requests is refused. A request rebuilt after a restart is numbered on
from the log's last entry, past a gap (store/output_log.py), read in one round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from radixserve.bus import BusError, BusMsg
from radixserve.detok import DEFAULT_MAX_REQUESTS, IncrementalDetokenizer, LostStream, StepGaps
from radixserve.protocol import (
    AbortRequest,
    DetokResync,
    StepOutputBatch,
    TextDelta,
    TextDeltaBatch,
    encode,
    encode_json,
    num_tokens,
    retry_later_error,
)
from radixserve.services.messages import decode_or_drop
from radixserve.services.runtime import (
    ENV_MODEL,
    ServiceContext,
    ServiceSettings,
    model_path_from,
    seconds_from_env,
    settings_from_args,
)
from radixserve.store import Store, StoreSettings
from radixserve.store.output_log import DEFAULT_TTL_S, LogEntry, OutputLog, OutputLogWriter
from radixserve.telemetry.detok_trace import DetokenizeSpans
from radixserve.telemetry.pipeline_metrics import DetokenizerMetrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SERVICE = "detokenizer"
ENV_MAX_REQUESTS = "RADIXSERVE_DETOK_MAX_REQUESTS"
ENV_OUTPUT_LOG_TTL_S = "RADIXSERVE_OUTPUT_LOG_TTL_S"
FLUSH_TIMEOUT_S = 5.0
LAST_SEQ_TIMEOUT_S = 1.0  # reading the log's numbers for requests rebuilt after a restart
EXPIRE_EVERY_S = 1.0  # how often requests whose history never came are failed


@dataclass(frozen=True)
class DetokenizerSettings:
    service: ServiceSettings
    model: str | None = None  # HF folder or .gguf; None: the embedded SmolLM2
    max_requests: int = DEFAULT_MAX_REQUESTS
    output_log_ttl_s: float = DEFAULT_TTL_S  # 0: no output log (no stream resumes)

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if not self.output_log_ttl_s >= 0:
            raise ValueError(f"--output-log-ttl-s must be >= 0, got {self.output_log_ttl_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=f"HF folder or .gguf whose tokenizer to use (default ${ENV_MODEL} or the "
        "embedded SmolLM2)",
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="live decoding states kept before the oldest is dropped "
        f"(default ${ENV_MAX_REQUESTS} or {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--output-log-ttl-s",
        type=float,
        default=None,
        help="how long resumable requests' deltas stay in Redis after the last one, for "
        f"clients that reconnect; 0: none kept (default ${ENV_OUTPUT_LOG_TTL_S} or "
        f"{DEFAULT_TTL_S:g})",
    )


def settings_from(ns: argparse.Namespace) -> DetokenizerSettings:
    max_requests = ns.max_requests
    if max_requests is None:
        raw = os.environ.get(ENV_MAX_REQUESTS, "").strip()
        try:
            max_requests = int(raw) if raw else DEFAULT_MAX_REQUESTS
        except ValueError:
            raise ValueError(f"${ENV_MAX_REQUESTS} must be an integer, got {raw!r}") from None
    ttl_s = ns.output_log_ttl_s
    if ttl_s is None:
        ttl_s = seconds_from_env(os.environ, ENV_OUTPUT_LOG_TTL_S, DEFAULT_TTL_S)
    return DetokenizerSettings(
        service=settings_from_args(SERVICE, ns),
        model=model_path_from(ns.model),
        max_requests=max_requests,
        output_log_ttl_s=ttl_s,
    )


def output_log_writer(
    ctx: ServiceContext, settings: DetokenizerSettings, metrics: DetokenizerMetrics
) -> OutputLogWriter | None:
    """The output log's writer, its drainer spawned; None when the log is off. Redis is not
    waited for: commands reconnect, and fail (dropped, counted) while it is away."""
    if settings.output_log_ttl_s == 0:
        return None
    store = Store(
        StoreSettings(
            url=settings.service.redis_url,
            key_prefix=StoreSettings.from_env().key_prefix,
            auth=settings.service.redis_auth,
        )
    )
    writer = OutputLogWriter(
        OutputLog(store, ttl_s=settings.output_log_ttl_s),
        on_dropped=metrics.output_log_dropped.inc,
        max_requests=settings.max_requests,
    )
    ctx.spawn(writer.run(), "output-log-writer")
    return writer


class LogNumbers:
    """Gives resumable requests' deltas their number in the output log (`TextDelta.seq`).

    A request rebuilt from its history that this detokenizer never numbered (it
    restarted) goes on after the log's last entry, past the gap; when the log cannot be
    read then, the request is logged no further (its resume is refused as incomplete).
    """

    def __init__(self, writer: OutputLogWriter, max_requests: int) -> None:
        self.writer = writer
        self.max_requests = max_requests
        self._unlogged: OrderedDict[str, None] = OrderedDict()

    async def number(
        self, deltas: list[TextDelta], resumable: Callable[[str], bool]
    ) -> list[TextDelta]:
        """`deltas` with those of resumable requests numbered (the rest as they are)."""
        rebuilt = sorted(
            {
                d.rid
                for d in deltas
                if d.resent and resumable(d.rid) and not self.writer.knows(d.rid)
            }
            - set(self._unlogged)
        )
        if rebuilt:
            try:
                last = await asyncio.wait_for(
                    self.writer.output_log.last_seqs(rebuilt), LAST_SEQ_TIMEOUT_S
                )
            except Exception as exc:  # Redis away: those requests cannot resume
                log.warning("output log numbers not read for %d request(s): %r", len(rebuilt), exc)
                last = {}
                for rid in rebuilt:
                    self._unlogged[rid] = None
                while len(self._unlogged) > self.max_requests:
                    self._unlogged.popitem(last=False)
            for rid, seq in last.items():
                self.writer.continue_after(rid, seq)
        return [
            msgspec.structs.replace(d, seq=self.writer.number(d.rid))
            if resumable(d.rid) and d.rid not in self._unlogged
            else d
            for d in deltas
        ]


def load_tokenizer(model: str | None) -> PreTrainedTokenizerBase:
    # Imported here: `radixserve serve detokenizer --help` must not pay for torch.
    from radixserve.model_files.paths import resolve_model_path
    from radixserve.model_files.tokenizer import load_tokenizer as load_from_folder

    return load_from_folder(resolve_model_path(model))


async def start(ctx: ServiceContext, settings: DetokenizerSettings) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, settings.model)
    detok = IncrementalDetokenizer(tokenizer, settings.max_requests)
    gaps = StepGaps()
    subjects = ctx.subjects
    metrics = DetokenizerMetrics(ctx.metrics)
    spans = DetokenizeSpans(max_open=settings.max_requests)
    log.info(
        "tokenizer loaded (%d ids); keeping up to %d streams", len(tokenizer), detok.max_requests
    )
    writer = output_log_writer(ctx, settings, metrics)
    numbers = None if writer is None else LogNumbers(writer, settings.max_requests)

    async def ask_history(rids: list[str], reason: str) -> None:
        """Every worker hears it; the one holding a request answers in `resent`."""
        try:
            await ctx.bus.publish(
                subjects.detok_resync, encode(DetokResync(rids=rids, reason=reason))
            )
        except BusError as exc:  # unanswered, the requests fail when their wait ends
            log.error("history of %d request(s) not asked for: %r", len(rids), exc)

    async def on_step(msg: BusMsg) -> None:
        batch = decode_or_drop(msg, StepOutputBatch, log)
        if batch is None:
            return
        missed = gaps.observe(batch.worker_id, batch.step)
        if missed:
            log.warning(
                "worker %s: %d step batch(es) missing before step %d (their text is lost)",
                batch.worker_id,
                missed,
                batch.step,
            )
        started = time.perf_counter()
        by_gateway = detok.process(batch)
        metrics.observe_batch(
            batch.worker_id,
            tokens=sum(num_tokens(out.new_token_ids) for out in batch.outputs),
            missed=missed,
            seconds=time.perf_counter() - started,
            live_streams=len(detok),
        )
        spans.observe(msg.headers, batch)
        for lost in detok.take_lost():
            await fail_lost(lost)
        asked = detok.take_resyncs()
        if asked:
            await ask_history(asked, "met mid-way")
        for gateway_id, deltas in by_gateway.items():
            if writer is not None and numbers is not None:
                deltas = await numbers.number(deltas, detok.resumable)
                writer.put(
                    [LogEntry(d.rid, d.seq, encode_json(d)) for d in deltas if d.seq is not None]
                )
            try:
                subject = subjects.gateway_deltas(gateway_id)
            except ValueError as exc:
                log.warning("dropped %d delta(s): %s", len(deltas), exc)
                continue
            await ctx.bus.publish(
                subject, encode(TextDeltaBatch(gateway_id=gateway_id, deltas=deltas))
            )

    async def fail_lost(lost: LostStream) -> None:
        """Its text would have a hole: 503 to its gateway, and an abort to stop the work."""
        metrics.observe_lost_request()
        error = retry_later_error(
            lost.rid,
            "output_lost",
            "part of the output was lost on its way (the detokenizer restarted or fell "
            "behind); retry",
            SERVICE,
        )
        abort = AbortRequest(rid=lost.rid, reason="output_lost")
        # The abort first, while the scheduler still has the request in flight (the error
        # takes it out; the scheduler then aborts it at its worker itself).
        try:
            await ctx.bus.publish(subjects.abort, encode(abort))
        except (BusError, ValueError) as exc:
            log.error("abort of a lost output not sent: %r", exc, extra={"rid": lost.rid})
        try:
            await ctx.bus.publish(subjects.gateway_errors(lost.gateway_id), encode(error))
        except (BusError, ValueError) as exc:  # the gateway's deadline answers the client
            log.error("lost output not reported: %r", exc, extra={"rid": lost.rid})

    async def expire_resyncs() -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            detok.expire()
            for lost in detok.take_lost():
                await fail_lost(lost)

    subscription = await ctx.bus.subscribe(subjects.detok, on_step)
    ctx.spawn(expire_resyncs(), "expire-resyncs")
    # A restart: what finished or ran on while this one was away comes back.
    await ask_history([], "detokenizer started")

    async def drain() -> None:
        await subscription.drain()  # the batches already queued are still decoded and sent
        await ctx.bus.nats_client.flush(timeout=FLUSH_TIMEOUT_S)  # type: ignore[arg-type]
        if writer is not None:
            if not await writer.flush(FLUSH_TIMEOUT_S):
                log.warning("%d output log batch(es) not written", writer.pending)
            await writer.output_log.store.close()
        log.info("drained with %d unfinished streams", len(detok))
        spans.end_all()

    ctx.on_drain(drain)
