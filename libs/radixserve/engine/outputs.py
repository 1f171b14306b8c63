"""Per-request bookkeeping on the engine's side: deltas and the result dict.

Text comes from `radixserve.detok`, the library the detokenizer service runs too:
one definition of incremental decoding, hold-back and stop trimming.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.detok import DecodeStatus, decode_step
from radixserve.engine.request import Req
from radixserve.protocol import DetokParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixserve.engine.sampling.params import SamplingParams


@dataclass
class Tracked:
    """One request the caller is waiting on."""

    req: Req
    started: float = field(default_factory=time.perf_counter)
    sent_token_len: int = 0
    decode_status: DecodeStatus | None = None  # streaming only: created by the first delta


def detok_params(params: SamplingParams) -> DetokParams:
    return DetokParams(
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=list(params.stop),
        no_stop_trim=params.no_stop_trim,
    )


def full_text(req: Req, tokenizer: PreTrainedTokenizerBase) -> str:
    """The whole output text at once (one decode), trimmed at the matched stop."""
    status = DecodeStatus(detok_params(req.params))
    return decode_step(tokenizer, status, req.output_ids, req.finish_reason, final=True)


def meta_info(t: Tracked) -> dict[str, Any]:
    req = t.req
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
        "e2e_latency": time.perf_counter() - t.started,
    }
    if req.params.return_logprob:
        meta["output_token_logprobs"] = [(lp.logprob, lp.token_id) for lp in req.logprobs]
        if req.params.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [lp.top for lp in req.logprobs]
        if req.params.logprob_start_len >= 0 and not req.resumed:  # sent before it resumed
            meta.update(input_logprobs_meta(req))
    return meta


def input_logprobs_meta(req: Req) -> dict[str, Any]:
    """SGLang's `input_token_logprobs` ([logprob, token id] per prompt token from
    logprob_start_len on; the prompt's first token has no logprob: None) and, with
    top_logprobs_num, `input_top_logprobs` (None for that first token too)."""
    head = req.input_logprob_head
    tokens: list[tuple[float | None, int]] = [] if head is None else [(None, head)]
    tokens += [(lp.logprob, lp.token_id) for lp in req.input_logprobs]
    meta: dict[str, Any] = {"input_token_logprobs": tokens}
    if req.params.top_logprobs_num > 0:
        tops: list[Any] = [] if head is None else [None]
        meta["input_top_logprobs"] = tops + [lp.top for lp in req.input_logprobs]
    return meta


def final_output(t: Tracked, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "text": full_text(t.req, tokenizer),
        "output_ids": list(t.req.output_ids),
        "meta_info": meta_info(t),
    }


def stream_delta(t: Tracked, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    """The text and tokens produced since the last delta, or None if there is nothing to send.

    Decodes only the new ids (with a short context); text that may still change is
    held back (see radixserve.detok).
    """
    req = t.req
    if t.decode_status is None:
        t.decode_status = DecodeStatus(detok_params(req.params))
    new_tokens = req.output_ids[t.sent_token_len :]
    finished = req.finished
    if not new_tokens and not finished:
        return None
    text = decode_step(tokenizer, t.decode_status, new_tokens, req.finish_reason)
    t.sent_token_len += len(new_tokens)
    return {
        "text": text,
        "output_ids": list(new_tokens),
        "finished": finished,
        "meta_info": meta_info(t),
    }
