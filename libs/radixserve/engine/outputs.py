"""Per-request bookkeeping on the engine's side: text so far, deltas, the result dict."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.request import Req
from radixserve.engine.sched.finish import trim_stop_string

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


@dataclass
class Tracked:
    """One request the caller is waiting on."""

    req: Req
    started: float = field(default_factory=time.perf_counter)
    sent_text_len: int = 0
    sent_token_len: int = 0
    done: bool = False
    children: list[Req] = field(default_factory=list)  # n > 1: released when this prefill finishes
    hidden: bool = False  # the shared-prefix prefill of n > 1: not returned to the caller


def full_text(req: Req, decode: Decode) -> str:
    text = decode(req.output_ids, req.params.skip_special_tokens)
    return trim_stop_string(text, req.finish_reason, req.params.no_stop_trim)


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
    return meta


def final_output(t: Tracked, decode: Decode) -> dict[str, Any]:
    return {
        "text": full_text(t.req, decode),
        "output_ids": list(t.req.output_ids),
        "meta_info": meta_info(t),
    }


def stream_delta(t: Tracked, decode: Decode) -> dict[str, Any] | None:
    """The text and tokens produced since the last delta, or None if there is nothing to send.

    Text that may still change is held back: a trailing partial UTF-8 character, and
    while unfinished, a tail that could be the start of a stop string.
    """
    req = t.req
    text = full_text(req, decode)
    finished = req.finished
    end = len(text)
    if not finished:
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        if req.params.stop:
            end = min(end, max(len(text) - (max(len(s) for s in req.params.stop) - 1), 0))
    end = max(end, t.sent_text_len)
    new_tokens = req.output_ids[t.sent_token_len :]
    if end == t.sent_text_len and not new_tokens and not finished:
        return None
    delta = {
        "text": text[t.sent_text_len : end],
        "output_ids": list(new_tokens),
        "finished": finished,
        "meta_info": meta_info(t),
    }
    t.sent_text_len = end
    t.sent_token_len = len(req.output_ids)
    return delta
