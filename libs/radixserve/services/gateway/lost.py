"""The lost-request check: requests whose end will never come, answered in seconds.

A request's last output (or its error) can be lost on its way back: published while no
detokenizer was subscribed (a restart), or dropped for a detokenizer that fell behind
(NATS drops messages of a slow consumer). Nothing else would ever arrive for it, and its
client would wait for the request timeout (600 s). Every `check_interval_s`, the gateway
asks the scheduler what became of the requests it has heard nothing of for `silence_s`
(`InflightQuery` on `{p}.scheduler.inflight`): the scheduler has every routed request
until it ends, and remembers when the last ones ended. A rid that ended at least
`silence_s / 2` ago (so its last output is not merely on its way, behind a slow
detokenizer) is answered 503 `request_lost` and aborted. A rid still in flight (queued
or running at a worker, however quiet) or unknown to the scheduler (still at the
tokenizer, or from before a scheduler restart) gets no verdict: its request timeout
stays the bound. So does every rid when no scheduler answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from radixserve.bus import BusError
from radixserve.protocol import InflightQuery, InflightReply, ProtocolError, decode, encode

if TYPE_CHECKING:
    from radixserve.services.gateway.state import GatewayState, Run

log = logging.getLogger(__name__)

# Rids per query: 2000 uuids are ~80 kB, well inside NATS's 1 MiB max_payload.
MAX_RIDS_PER_QUERY = 2000
QUERY_TIMEOUT_S = 5.0


def check_interval_s(silence_s: float) -> float:
    return min(max(silence_s / 3, 0.2), 10.0)


async def check_lost_requests(state: GatewayState, silence_s: float) -> None:
    """Forever: find and fail lost requests (a supervised task of the gateway)."""
    while True:
        await asyncio.sleep(check_interval_s(silence_s))
        try:
            await check_once(state, silence_s)
        except (BusError, ProtocolError, TimeoutError) as exc:  # no scheduler answered
            log.debug("lost-request check skipped: %r", exc)
        except Exception:  # a defect here must not stop the gateway: the deadline remains
            log.exception("lost-request check failed")


async def check_once(state: GatewayState, silence_s: float) -> int:
    """One round; how many requests it failed as lost."""
    now = time.monotonic()
    quiet: dict[Run, float] = {}
    for run in list(state.inflight):
        since = run.silent_since()
        if since is not None and now - since >= silence_s:
            quiet[run] = since
    if not quiet:
        return 0
    rids = [rid for run in quiet for rid in run.assembly.unfinished_rids()]
    ended: dict[str, float] = {}
    for first in range(0, len(rids), MAX_RIDS_PER_QUERY):
        query = InflightQuery(rids=rids[first : first + MAX_RIDS_PER_QUERY])
        raw = await state.bus.request(
            state.subjects.scheduler_inflight, encode(query), timeout_s=QUERY_TIMEOUT_S
        )
        ended.update(decode(raw.data, InflightReply).ended)
    failed = 0
    for run, since in quiet.items():
        if run.silent_since() != since:  # something came meanwhile
            continue
        lost = [
            rid for rid in run.assembly.unfinished_rids() if ended.get(rid, -1.0) >= silence_s / 2
        ]
        if lost:
            log.warning(
                "no word of %d rid(s) for %.0fs, which the scheduler saw end %.0fs ago: "
                "failing the request as lost",
                len(lost),
                time.monotonic() - since,
                min(ended[rid] for rid in lost),
                extra={"rid": run.rid},
            )
            run.report_lost()
            failed += 1
    return failed
