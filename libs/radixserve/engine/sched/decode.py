"""Decode-side memory: make room for one new token per running request, retracting if needed.

A retracted request gives its KV back (what it computed goes into the prefix cache,
so a later re-prefill may find it there), keeps its output tokens, and goes back to
the front of the waiting queue; nothing it produced is lost. The request mid-chunk
is retracted first: it has produced nothing yet, and decoding requests must never be
starved (or aborted as "too large") by a prefill that is still being admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.request import Req, ReqStatus
from radixserve.engine.sched.kv_manager import KVManager


@dataclass(frozen=True)
class DecodeMemory:
    keep: list[Req]  # requests that decode this step
    retracted: list[Req]  # back to waiting, in the order they should resume (the chunked one last)
    unservable: list[Req]  # could not fit even alone: the caller finishes them with an error


def retract(kv: KVManager, req: Req) -> None:
    """Give back the request's KV (its computed pages stay in the cache) and mark it waiting."""
    assert req.num_pending == 0, "retracting a request whose last token is still on the device"
    kv.release(req)
    req.status = ReqStatus.WAITING
    req.prefill_done = False
    req.num_retractions += 1


def ensure_decode_memory(kv: KVManager, running: list[Req], chunked: Req | None) -> DecodeMemory:
    """Retract the request mid-chunk, then the requests with the least progress, until
    every other running request has a slot for its next token.

    Counted in whole pages: a request needs a new page only when its last one is full.
    """
    keep = list(running)
    # The ones that lose least when retracted go last: fewest outputs, longest prompt.
    keep.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    need = kv.decode_slots_needed(keep)
    if chunked is not None and keep and kv.available_tokens() < need:
        retract(kv, chunked)
        retracted.append(chunked)
    while len(keep) > 1 and kv.available_tokens() < need:
        victim = keep.pop()
        need -= kv.slots_needed(victim, 1)  # before release resets its kv_len
        retract(kv, victim)
        retracted.append(victim)
    unservable: list[Req] = []
    if keep and kv.available_tokens() < need:
        unservable = keep
        keep = []
    retracted.reverse()
    return DecodeMemory(keep=keep, retracted=retracted, unservable=unservable)
