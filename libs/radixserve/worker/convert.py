"""Between wire messages and the engine's step API: requests in, step outputs out."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
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
    choice_prefixes: list[bytes | None] | None = None,
) -> None:
    """Queue a routed request on the engine: its prompt, parameters and priority (and
    its compiled grammar, if constrained). `output_prefix` / `choice_prefixes` (a
    re-routed request's, as in `RoutedRequest`, packed): the tokens it (n == 1) or each
    unfinished choice (n > 1) already generated, which it continues after; a finished
    choice is not run. Raises ValueError for bad input."""
    params = engine_params(request.sampling)
    ids = protocol.unpack_tokens_array(request.input_ids)  # checked by the engine
    resume = None if output_prefix is None else protocol.unpack_tokens_array(output_prefix)
    choices = None
    if choice_prefixes is not None:
        choices = {
            index: protocol.unpack_tokens_array(prefix)
            for index, prefix in enumerate(choice_prefixes)
            if prefix is not None
        }
    engine.submit(
        ids,
        params,
        rid=request.rid,
        grammar=grammar,
        priority=request.priority,
        resume_ids=resume,
        resume_choices=choices,
    )


RECENT_S = 30.0  # how long a finished choice's history is kept for a detokenizer resync
RECENT_MAX = 4096  # finished choices' histories kept at most (the oldest dropped)


@dataclass
class OutputBuilder:
    """Turns the engine's `ChoiceOutput`s into `StepOutput`s, remembering per request
    which gateway owns it and which choices have already sent their `DetokParams`.

    It also answers a detokenizer that lost its state (`history`): each announced choice's
    `Req` is kept while it runs, and a finished choice's last `StepOutput`, with its whole
    output, for `recent_s` (at most `recent_max` of them), so what finished while the
    detokenizer was away is not lost either.
    """

    gateways: dict[str, str] = field(default_factory=dict)  # rid -> gateway id
    unfinished: dict[str, int] = field(default_factory=dict)  # rid -> choices still running
    announced: dict[tuple[str, int], Req] = field(default_factory=dict)  # running choices
    resumable: set[str] = field(default_factory=set)  # rids whose deltas the detokenizer logs
    recent: OrderedDict[tuple[str, int], tuple[float, protocol.StepOutput]] = field(
        default_factory=OrderedDict
    )
    recent_s: float = RECENT_S
    recent_max: int = RECENT_MAX
    clock: Callable[[], float] = time.monotonic

    def track(self, rid: str, gateway_id: str, n: int, *, resumable: bool = False) -> None:
        """Publish `rid`'s outputs until `n` choices finish: the ones the engine runs (a
        resumed request's unfinished ones)."""
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
        for key in [key for key in self.announced if key[0] == rid]:
            del self.announced[key]

    def build(self, out: ChoiceOutput) -> protocol.StepOutput | None:
        gateway_id = self.gateways.get(out.rid)
        if gateway_id is None:
            return None
        req = out.req
        key = (out.rid, out.index)
        detok = prompt = None
        if key not in self.announced:
            self.announced[key] = req
            detok = self._detok_params(req)
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
            self._keep_recent(key, self._history(req, key, gateway_id))
            self.announced.pop(key, None)
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
            finish_reason=wire_finish(req),
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            token_logprobs=token_logprobs,
            top_logprobs=top_logprobs,
            detok=detok,
            prompt_logprobs=prompt,
        )

    def history(self, rids: Collection[str] = ()) -> list[protocol.StepOutput]:
        """The whole output so far of each choice of `rids` (every request when empty)
        that has sent an output: running ones, and those finished in the last `recent_s`
        (with their finish). For `StepOutputBatch.resent`; called between steps."""
        self._expire_recent()
        wanted = set(rids)
        outputs = [
            self._history(req, key, self.gateways[key[0]])
            for key, req in self.announced.items()
            if not wanted or key[0] in wanted
        ]
        outputs += [out for key, (_, out) in self.recent.items() if not wanted or key[0] in wanted]
        outputs.sort(key=lambda out: (out.rid, out.index))
        return outputs

    def _detok_params(self, req: Req) -> protocol.DetokParams:
        detok = detok_params(req.params)
        if req.rid in self.resumable:
            detok = msgspec.structs.replace(detok, resumable=True)
        return detok

    def _history(self, req: Req, key: tuple[str, int], gateway_id: str) -> protocol.StepOutput:
        token_logprobs = top_logprobs = None
        # Logprobs only where every id has one (a resumed request's first ids came from
        # another worker, which sent their logprobs).
        if req.params.return_logprob and len(req.logprobs) == len(req.output_ids):
            token_logprobs = [lp.logprob for lp in req.logprobs]
            if req.params.top_logprobs_num > 0:
                top_logprobs = wire_top(req.logprobs)
        return protocol.StepOutput(
            rid=key[0],
            gateway_id=gateway_id,
            new_token_ids=protocol.pack_tokens(req.output_ids),
            index=key[1],
            finish_reason=wire_finish(req),
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            token_logprobs=token_logprobs,
            top_logprobs=top_logprobs,
            detok=self._detok_params(req),
            prompt_logprobs=prompt_logprobs(req),
        )

    def _keep_recent(self, key: tuple[str, int], out: protocol.StepOutput) -> None:
        self.recent[key] = (self.clock(), out)
        self.recent.move_to_end(key)
        while len(self.recent) > self.recent_max:
            self.recent.popitem(last=False)

    def _expire_recent(self) -> None:
        oldest = self.clock() - self.recent_s
        while self.recent and next(iter(self.recent.values()))[0] < oldest:
            self.recent.popitem(last=False)


def wire_finish(req: Req) -> protocol.FinishReason | None:
    reason = req.finish_reason
    if reason is None:
        return None
    return protocol.FinishReason(
        kind=reason.kind,  # type: ignore[arg-type]
        matched=reason.matched,
        message=reason.message,
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
