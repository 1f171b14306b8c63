"""Between wire messages and the engine's step API: requests in, step outputs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from radixserve import protocol
from radixserve.engine.groups import ChoiceOutput
from radixserve.engine.outputs import detok_params
from radixserve.engine.request import Req, TokenLogprob
from radixserve.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine


def engine_params(wire: protocol.SamplingParams) -> SamplingParams:
    """The engine's validated form of the wire parameters (same field names)."""
    return SamplingParams.from_dict(msgspec.structs.asdict(wire))


def submit_request(
    engine: Engine,
    request: protocol.TokenizedRequest,
    grammar: Any = None,
    output_prefix: bytes | None = None,
) -> SamplingParams:
    """Queue a routed request on the engine: its prompt, parameters and priority (and
    its compiled grammar, if constrained). `output_prefix` (a re-routed request's
    `RoutedRequest.output_prefix`, packed): the tokens it already generated, which it
    continues after. Returns the engine's form of the parameters; raises ValueError for
    bad input."""
    params = engine_params(request.sampling)
    ids = protocol.unpack_tokens_array(request.input_ids)  # checked by the engine
    resume = None if output_prefix is None else protocol.unpack_tokens_array(output_prefix)
    engine.submit(
        ids,
        params,
        rid=request.rid,
        grammar=grammar,
        priority=request.priority,
        resume_ids=resume,
    )
    return params


@dataclass
class OutputBuilder:
    """Turns the engine's `ChoiceOutput`s into `StepOutput`s, remembering per request
    which gateway owns it and which choices have already sent their `DetokParams`."""

    gateways: dict[str, str] = field(default_factory=dict)  # rid -> gateway id
    unfinished: dict[str, int] = field(default_factory=dict)  # rid -> choices still running
    announced: set[tuple[str, int]] = field(default_factory=set)
    resumable: set[str] = field(default_factory=set)  # rids whose deltas the detokenizer logs

    def track(self, rid: str, gateway_id: str, n: int, *, resumable: bool = False) -> None:
        self.gateways[rid] = gateway_id
        self.unfinished[rid] = n
        if resumable:
            self.resumable.add(rid)

    def __len__(self) -> int:
        return len(self.gateways)

    def forget(self, rid: str) -> None:
        """Publish nothing more for `rid` (handed to another worker)."""
        self.gateways.pop(rid, None)
        self.unfinished.pop(rid, None)
        self.resumable.discard(rid)
        self.announced = {key for key in self.announced if key[0] != rid}

    def build(self, out: ChoiceOutput) -> protocol.StepOutput | None:
        gateway_id = self.gateways.get(out.rid)
        if gateway_id is None:
            return None
        req = out.req
        key = (out.rid, out.index)
        detok = prompt = None
        if key not in self.announced:
            self.announced.add(key)
            detok = detok_params(req.params)
            if out.rid in self.resumable:
                detok = msgspec.structs.replace(detok, resumable=True)
            prompt = prompt_logprobs(req)
        reason = req.finish_reason
        token_logprobs = top_logprobs = None
        if req.params.return_logprob:
            token_logprobs = [lp.logprob for lp in out.new_logprobs]
            if req.params.top_logprobs_num > 0:
                top_logprobs = wire_top(out.new_logprobs)
            if len(token_logprobs) != len(out.new_token_ids):  # an abort carries no tokens
                token_logprobs = top_logprobs = None
        if reason is not None:
            self.announced.discard(key)
            self.unfinished[out.rid] -= 1
            if self.unfinished[out.rid] <= 0:
                del self.unfinished[out.rid]
                del self.gateways[out.rid]
                self.resumable.discard(out.rid)
        return protocol.StepOutput(
            rid=out.rid,
            gateway_id=gateway_id,
            new_token_ids=protocol.pack_tokens(out.new_token_ids),
            index=out.index,
            finish_reason=None
            if reason is None
            else protocol.FinishReason(
                kind=reason.kind,  # type: ignore[arg-type]
                matched=reason.matched,
                message=reason.message,
            ),
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            token_logprobs=token_logprobs,
            top_logprobs=top_logprobs,
            detok=detok,
            prompt_logprobs=prompt,
        )


def prompt_logprobs(req: Req) -> protocol.PromptLogprobs | None:
    """The prompt's scored tokens, for a request that asked and whose prefill scored them
    all (not one aborted before, nor one resumed: its first worker sent them)."""
    params = req.params
    scored = params.return_logprob and params.logprob_start_len >= 0
    if not scored or req.input_logprob_next != -1 or req.resumed:
        return None
    entries = req.input_logprobs
    head = req.input_logprob_head
    return protocol.PromptLogprobs(
        token_ids=protocol.pack_tokens([lp.token_id for lp in entries]),
        logprobs=[lp.logprob for lp in entries],
        top=wire_top(entries) if params.top_logprobs_num > 0 else None,
        head_token_id=-1 if head is None else head,
    )


def wire_top(entries: list[TokenLogprob]) -> list[protocol.TopLogprobs]:
    """Each entry's top-k candidates, packed for the wire."""
    return [
        protocol.TopLogprobs(
            token_ids=protocol.pack_tokens([t for t, _ in lp.top]),
            logprobs=[v for _, v in lp.top],
        )
        for lp in entries
    ]
