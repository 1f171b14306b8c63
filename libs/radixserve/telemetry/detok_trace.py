"""The detokenizer's spans: one per choice, from its first step output to its finish.

    traces = DetokenizeSpans(max_open=65536)
    traces.observe(msg.headers, batch)     # after decoding each StepOutputBatch

Each span's parent is the worker's request span, read from the batch's
`radixserve-traceparents` header (one entry per output that opens a choice); a choice
without one (tracing off at the worker) gets no span. Counts only, never text.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.trace import SpanKind, Tracer

from radixserve.protocol import StepOutputBatch
from radixserve.telemetry import genai
from radixserve.telemetry.tracing import RequestSpans, decode_batch_contexts, get_tracer

_tracer = get_tracer("detokenizer")  # a proxy: real once setup_tracing installs a provider


class DetokenizeSpans:
    def __init__(self, max_open: int = 65536, tracer: Tracer | None = None) -> None:
        self.open = RequestSpans(max_open)
        self.tracer = tracer or _tracer

    def observe(self, headers: Mapping[str, str] | None, batch: StepOutputBatch) -> None:
        parents = decode_batch_contexts(headers) if headers else {}
        if not parents and not len(self.open):
            return
        for i, out in enumerate(batch.outputs):
            key = f"{out.rid}\x00{out.index}"
            parent = parents.get(i)
            if parent is not None and key not in self.open:
                attributes: dict[str, str | int] = {
                    genai.REQUEST_ID: out.rid,
                    genai.WORKER_ID: batch.worker_id,
                }
                if out.index:
                    attributes["radixserve.choice.index"] = out.index
                span = self.tracer.start_span(
                    genai.SPAN_DETOKENIZE,
                    context=parent,
                    kind=SpanKind.CONSUMER,
                    attributes=attributes,
                )
                self.open.add(key, span)
            if out.finish_reason is None:
                continue
            finished = self.open.pop(key)
            if finished is not None:
                finished.set_attribute(genai.USAGE_OUTPUT_TOKENS, out.completion_tokens)
                finished.set_attribute(genai.RESPONSE_FINISH_REASONS, [out.finish_reason.kind])
                finished.end()

    def end_all(self) -> None:
        self.open.end_all()
