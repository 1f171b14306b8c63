"""The scheduler service's library: worker registry, routing, in-flight table, backpressure.

    dispatcher = Dispatcher(max_pending_requests=1024, worker_timeout_s=5.0, retry_after_s=1.0)
    match dispatcher.admit(tokenized, time.monotonic(), time.time()):
        case Routed(routed): ...      # publish on subjects.worker_run(routed.worker_id)
        case Rejected(gateway_id, error): ...   # publish on subjects.gateway_errors(gateway_id)
        case Dropped(reason): ...

`Router` is the seam: `CacheAwareRouter` (the default, `routing="cache_aware"`) weighs
the prefix each worker caches, as its `KvMirrors` copy of that worker's radix cache
says (kept from the KV events via `on_kv_events`), against load; `LeastLoadRouter`
(`routing="least_load"`) weighs load only. Nothing here does I/O.
"""

from __future__ import annotations

from radixserve.routing.aborts import RecentAborts
from radixserve.routing.acks import PendingAcks
from radixserve.routing.dispatcher import (
    NO_WORKER,
    QUEUE_FULL,
    REQUEST_LOST,
    ROUTING_POLICIES,
    UNLISTED_AFTER_S,
    WORKER_LOST,
    Decision,
    Dispatcher,
    Dropped,
    Rejected,
    Routed,
)
from radixserve.routing.flush import merge_flush_replies
from radixserve.routing.inflight import InflightEntry, InflightTable
from radixserve.routing.kv_mirror import KvMirrors, PromptHashes, WorkerMirror
from radixserve.routing.progress import ChoiceProgress, step_progress
from radixserve.routing.registry import WorkerRegistry, WorkerState
from radixserve.routing.router import (
    CacheAwareRouter,
    LeastLoadRouter,
    Route,
    Router,
    WorkerLoad,
)

__all__ = [
    "NO_WORKER",
    "QUEUE_FULL",
    "REQUEST_LOST",
    "ROUTING_POLICIES",
    "UNLISTED_AFTER_S",
    "WORKER_LOST",
    "CacheAwareRouter",
    "ChoiceProgress",
    "Decision",
    "Dispatcher",
    "Dropped",
    "InflightEntry",
    "InflightTable",
    "KvMirrors",
    "LeastLoadRouter",
    "PendingAcks",
    "PromptHashes",
    "RecentAborts",
    "Rejected",
    "Route",
    "Routed",
    "Router",
    "WorkerLoad",
    "WorkerMirror",
    "WorkerRegistry",
    "WorkerState",
    "merge_flush_replies",
    "step_progress",
]
