"""tokenizer service: `SubmitRequest` -> checked `TokenizedRequest` (docs/request-path.md, hop 2).

Takes `{p}.tokenize` in the queue group `tokenizer` (N replicas; acknowledged on receipt),
renders chat messages with the model's template, tokenizes text, passes input_ids
through; checks the vocabulary and `--context-length` (which must match the workers');
has constrained requests' grammars compiled on `{p}.grammar.compile` (no answer within
`--grammar-timeout-s`: 503 `grammar_unavailable`); sends the result to `{p}.schedule` as
a request the scheduler acknowledges (none within `--schedule-ack-timeout-s`: 503
`scheduler_unreachable`, and an abort in case it arrives late). Every refusal goes to the
owning gateway's errors subject. Every replica hears `{p}.abort` (no queue group) and
drops a request aborted while it waited here (remembered 600 s). Each message gets its
own task (256 at once), tokenizing runs on one thread off the event loop; on SIGTERM it
takes no new messages and finishes those it holds. The logic lives in
`radixserve.prep`; this file only moves messages.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.bus import BusError, BusMsg, BusNoResponders, BusPayloadTooLarge, BusTimeout
from radixserve.protocol import (
    REQUEST_TOO_LARGE,
    AbortRequest,
    GrammarCompileReply,
    ProtocolError,
    QueueGroups,
    RequestError,
    SubmitRequest,
    TokenizedRequest,
    decode,
    encode,
    retry_later_error,
    too_large_error,
)
from radixserve.routing import RecentAborts
from radixserve.services.messages import decode_or_drop
from radixserve.services.runtime import (
    ENV_MODEL,
    ServiceContext,
    ServiceSettings,
    model_path_from,
    settings_from_args,
)
from radixserve.telemetry import genai
from radixserve.telemetry.pipeline_metrics import TokenizerMetrics
from radixserve.telemetry.tracing import get_tracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from radixserve.prep import GrammarSpec, PromptTokenizer

log = logging.getLogger(__name__)

SERVICE = "tokenizer"
_tracer = get_tracer(SERVICE)
# Aborts kept as long as the longest a gateway waits for a request (its default timeout).
ABORT_MEMORY_S = 600.0


@dataclass(frozen=True)
class TokenizerSettings:
    service: ServiceSettings
    model: str | None = None  # None: the embedded SmolLM2
    context_length: int | None = None  # None: the model's max_position_embeddings
    grammar_timeout_s: float = 5.0
    # How long the scheduler has to acknowledge a request it was sent; then 503.
    schedule_ack_timeout_s: float = 10.0
    # Requests in progress at once (most of them waiting on the grammar service);
    # past it the subscription waits and NATS buffers.
    max_concurrent_requests: int = 256

    def __post_init__(self) -> None:
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError(f"--context-length must be > 0, got {self.context_length}")
        if self.grammar_timeout_s <= 0:
            raise ValueError(f"--grammar-timeout-s must be > 0, got {self.grammar_timeout_s}")
        if self.schedule_ack_timeout_s <= 0:
            raise ValueError(
                f"--schedule-ack-timeout-s must be > 0, got {self.schedule_ack_timeout_s}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=f"HF folder or .gguf (default ${ENV_MODEL}, else the embedded SmolLM2)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="prompt + max_new_tokens limit; must match the workers' (default: the model's "
        "max_position_embeddings)",
    )
    parser.add_argument("--grammar-timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--schedule-ack-timeout-s",
        type=float,
        default=10.0,
        help="answer 503 when the scheduler has not acknowledged a request within this long",
    )


def settings_from(ns: argparse.Namespace) -> TokenizerSettings:
    return TokenizerSettings(
        service=settings_from_args(SERVICE, ns),
        model=model_path_from(ns.model),
        context_length=ns.context_length,
        grammar_timeout_s=ns.grammar_timeout_s,
        schedule_ack_timeout_s=ns.schedule_ack_timeout_s,
    )


async def start(ctx: ServiceContext, settings: TokenizerSettings) -> None:
    # Heavy imports (transformers) only once the service really starts: `--help` stays quick.
    from radixserve.model_files.paths import resolve_model_path
    from radixserve.prep import load_prompt_tokenizer

    model_dir = await asyncio.to_thread(resolve_model_path, settings.model)
    prompter = await asyncio.to_thread(load_prompt_tokenizer, model_dir, settings.context_length)
    log.info(
        "tokenizer of %s: vocabulary %d, context length %d, id %s",
        model_dir,
        prompter.vocab_size,
        prompter.context_len,
        prompter.tokenizer_id,
    )
    handler = _Tokenizer(ctx, settings, prompter, TokenizerMetrics(ctx.metrics))
    # Every replica hears every abort (no queue group): a request still waiting here
    # when its gateway gave up is dropped, not tokenized and run for nobody.
    await ctx.bus.subscribe(ctx.subjects.abort, handler.on_abort)
    subscription = await ctx.bus.subscribe(
        ctx.subjects.tokenize, handler.on_message, queue=QueueGroups.TOKENIZER
    )

    async def drain() -> None:
        await subscription.drain()  # no new requests; the queued ones get their task
        await handler.wait_idle()

    ctx.on_drain(drain)


class _Tokenizer:
    """One task per message (bounded), so a request waiting on the grammar service or a
    long prompt being tokenized does not hold up the ones behind it."""

    def __init__(
        self,
        ctx: ServiceContext,
        settings: TokenizerSettings,
        prompter: PromptTokenizer,
        metrics: TokenizerMetrics,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.prompter = prompter
        self.metrics = metrics
        self._slots = asyncio.Semaphore(settings.max_concurrent_requests)
        self._active: set[asyncio.Task[Any]] = set()
        # NOTE: one thread, because a Hugging Face fast tokenizer shared between threads
        # can fail with "Already borrowed"; it still keeps tokenizing off the event loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Aborted rids, as long as a gateway waits for a request: a request acknowledged
        # here can wait behind a backlog long after its gateway answered 503 and aborted.
        self._aborted = RecentAborts(ttl_s=ABORT_MEMORY_S)

    async def on_message(self, msg: BusMsg) -> None:
        await self.ctx.bus.acknowledge(msg)  # received: the gateway stops waiting for it
        await self._slots.acquire()
        task = self.ctx.spawn(self._handle(msg), name="tokenize-request")
        self._active.add(task)
        task.add_done_callback(self._active.discard)

    async def on_abort(self, msg: BusMsg) -> None:
        abort = decode_or_drop(msg, AbortRequest, log)
        if abort is None:
            return
        self._aborted.add(abort.rid, time.monotonic())

    def _dropped(self, rid: str, when: str) -> bool:
        """True (and logged, counted) if `rid` was aborted: nobody waits for it."""
        if not self._aborted.consume(rid, time.monotonic()):
            return False
        log.info("aborted %s: dropped", when, extra={"rid": rid})
        self.metrics.observe_refused("aborted")
        return True

    async def wait_idle(self) -> None:
        if self._active:
            await asyncio.gather(*self._active, return_exceptions=True)
        self._executor.shutdown(wait=False)

    async def _handle(self, msg: BusMsg) -> None:
        try:
            await self._process(msg)
        finally:
            self._slots.release()

    async def _process(self, msg: BusMsg) -> None:
        from radixserve.prep import PrepError, request_address

        try:
            req = decode(msg.data, SubmitRequest)
        except ProtocolError as exc:
            address = request_address(msg.data)
            log.warning("malformed SubmitRequest: %s", exc, extra={"rid": address and address[0]})
            if address is not None:
                rid, gateway_id = address
                self.metrics.observe_refused("invalid_request_error")
                await self._send_error(gateway_id, PrepError(str(exc)).to_request_error(rid))
            return
        # Parent: the gateway's span (the handler runs in the sender's context); what is
        # published below (grammar compile, schedule) continues from this span.
        with _tracer.start_as_current_span(
            genai.SPAN_TOKENIZE, attributes={genai.REQUEST_ID: req.rid}
        ) as span:
            await self._process_request(req, span)

    async def _process_request(self, req: SubmitRequest, span: Span) -> None:
        from radixserve.prep import PrepError

        if self._dropped(req.rid, "before it was tokenized"):
            return
        try:
            tokenized = await self._tokenize(req)
        except PrepError as err:
            log.info("request refused: %s (%s)", err.code, err.param, extra={"rid": req.rid})
            self.metrics.observe_refused(err.code)
            span.set_attribute(genai.ERROR_CODE, err.code)
            await self._send_error(req.gateway_id, err.to_request_error(req.rid, SERVICE))
            return
        except Exception as exc:  # one request's bug must not stop the replica or hang the client
            log.exception("tokenizing failed", extra={"rid": req.rid})
            self.metrics.observe_refused("internal_error")
            error = RequestError(
                rid=req.rid,
                code="internal_error",
                message=f"the tokenizer failed: {type(exc).__name__}",
                http_status=500,
                error_type="server_error",
                service=SERVICE,
            )
            await self._send_error(req.gateway_id, error)
            return
        log.debug("tokenized: %d prompt tokens", tokenized.prompt_tokens, extra={"rid": req.rid})
        span.set_attribute(genai.USAGE_INPUT_TOKENS, tokenized.prompt_tokens)
        if self._dropped(req.rid, "while it was tokenized"):
            return
        await self._schedule(req, tokenized)

    async def _schedule(self, req: SubmitRequest, tokenized: TokenizedRequest) -> None:
        """Send to the scheduler, which acknowledges on receipt; the gateway hears 503 when
        no scheduler runs or none acknowledges in time (a lost message would otherwise
        keep the client waiting for its whole request timeout)."""
        timeout_s = self.settings.schedule_ack_timeout_s
        try:
            await self.ctx.bus.request(
                self.ctx.subjects.schedule, encode(tokenized), timeout_s=timeout_s
            )
            return
        except BusPayloadTooLarge:
            # Token ids take 4 bytes each: a prompt under the limit as text may pass it.
            self.metrics.observe_refused(REQUEST_TOO_LARGE)
            await self._send_error(
                req.gateway_id, too_large_error(req.rid, SERVICE, "to the scheduler as tokens")
            )
            return
        except BusNoResponders:
            message = "no scheduler is running; retry"
        except BusTimeout:
            message = f"the scheduler did not acknowledge the request within {timeout_s:g} s; retry"
            # It may still get there late: it must not run with nobody waiting for it.
            await self._publish_abort(req.rid)
        except BusError as exc:
            message = "the tokenizer could not reach the scheduler; retry"
            log.error("not sent to the scheduler: %r", exc, extra={"rid": req.rid})
        log.warning("%s", message, extra={"rid": req.rid})
        self.metrics.observe_refused("scheduler_unreachable")
        error = retry_later_error(req.rid, "scheduler_unreachable", message, SERVICE)
        await self._send_error(req.gateway_id, error)

    async def _publish_abort(self, rid: str) -> None:
        abort = AbortRequest(rid=rid, reason="scheduler_unresponsive")
        try:
            await self.ctx.bus.publish(self.ctx.subjects.abort, encode(abort))
        except BusError as exc:
            log.error("abort not sent to the scheduler: %r", exc, extra={"rid": rid})

    async def _tokenize(self, req: SubmitRequest) -> TokenizedRequest:
        from radixserve.prep import grammar_spec, tokenized_request

        # Markers first: the strict tools' tag is a grammar, which the markers' check skips.
        req = self.prompter.with_strict_tools(self.prompter.with_call_markers(req))
        spec = grammar_spec(req.sampling)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        prompt = await loop.run_in_executor(self._executor, self.prompter.prepare, req)
        seconds = time.perf_counter() - started
        key = None if spec is None else await self._compile_grammar(req.rid, spec)
        tokenized = tokenized_request(req, prompt, key)
        self.metrics.observe_tokenized(tokenized.prompt_tokens, seconds)
        return tokenized

    async def _compile_grammar(self, rid: str, spec: GrammarSpec) -> str:
        from radixserve.prep import compile_request, key_from_reply, unavailable_error

        request = compile_request(rid, spec, self.prompter.tokenizer_id)
        timeout_s = self.settings.grammar_timeout_s
        try:
            with self.ctx.metrics.time_nats("grammar.compile"):
                raw = await self.ctx.bus.request(
                    self.ctx.subjects.grammar_compile, encode(request), timeout_s=timeout_s
                )
        except BusTimeout as exc:
            raise unavailable_error(spec, f"no reply within {timeout_s:g}s") from exc
        except BusNoResponders as exc:
            raise unavailable_error(spec, "no grammar service is running") from exc
        try:
            reply = decode(raw.data, GrammarCompileReply)
        except ProtocolError as exc:
            raise unavailable_error(spec, f"unreadable reply: {exc}") from exc
        return key_from_reply(reply, spec)

    async def _send_error(self, gateway_id: str, error: RequestError) -> None:
        try:
            await self.ctx.bus.publish(self.ctx.subjects.gateway_errors(gateway_id), encode(error))
        except BusError as exc:  # the gateway's own deadline answers the client
            log.error("error not sent to the gateway: %r", exc, extra={"rid": error.rid})
