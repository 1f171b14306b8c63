"""Decode-side memory: make room for one new token per running request, retracting if needed.

A retracted request gives its KV back (what it computed goes into the prefix cache,
so a later re-prefill may find it there), keeps its output tokens, and goes back to
the front of the waiting queue; nothing it produced is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.request import Req, ReqStatus
from radixserve.engine.sched.kv_manager import KVManager


@dataclass(frozen=True)
class DecodeMemory:
    keep: list[Req]  # requests that decode this step
    retracted: list[Req]  # back to waiting, in the order they should resume
    unservable: list[Req]  # could not fit even alone: the caller finishes them with an error


def ensure_decode_memory(kv: KVManager, running: list[Req], extra_tokens: int = 0) -> DecodeMemory:
    """Retract the requests with the least progress until every other one has a slot.

    Counted in whole pages: a request needs a new page only when its last one is full.
    """
    keep = list(running)
    # The ones that lose least when retracted go last: fewest outputs, longest prompt.
    keep.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    need = kv.decode_slots_needed(keep)
    while keep and kv.available_tokens() < need + extra_tokens:
        if len(keep) == 1 and extra_tokens == 0:
            break
        victim = keep.pop()
        need -= kv.slots_needed(victim, 1)  # before release resets its kv_len
        kv.release(victim)
        victim.status = ReqStatus.WAITING
        victim.prefill_done = False
        victim.num_retractions += 1
        retracted.append(victim)
    unservable: list[Req] = []
    if keep and kv.available_tokens() < need:
        unservable = keep
        keep = []
    retracted.reverse()
    return DecodeMemory(keep=keep, retracted=retracted, unservable=unservable)
