"""What services report about themselves: worker load (`WorkerStats`), worker liveness
(`Heartbeat`), and every service's liveness (`ServiceHeartbeat`)."""

from __future__ import annotations

import enum

import msgspec

from radixserve.protocol.base import Message


class WorkerStatus(enum.StrEnum):
    STARTING = "starting"  # loading weights; do not route yet
    READY = "ready"
    DRAINING = "draining"  # finishing what it holds; route nothing new
    STOPPING = "stopping"


class WorkerCapacity(Message, frozen=True):
    """Fixed at start-up: what the worker can hold at most."""

    max_running_requests: int
    max_total_num_tokens: int  # KV pool size in tokens
    max_context_len: int
    page_size: int = 1
    kv_block_size: int = 1  # block size of its KV events (see `kv_events.block_hashes`)


class HeldRequest(Message, frozen=True):
    """A request a worker is running, as its heartbeat lists it: a scheduler that
    restarted learns from these what is in flight where."""

    rid: str
    gateway_id: str
    choices: int = 1


class Heartbeat(Message, frozen=True):
    """worker -> scheduler, every few seconds: alive, what it serves, how big it is.

    A worker missing several heartbeats is dead: the scheduler re-routes its requests.
    `epoch` and `kv_event_seq` (the last KV event batch published) let the scheduler
    check its mirror of this worker's radix tree is current. `requests`: what it runs
    (a restarted scheduler rebuilds its in-flight table from them), all of it when
    `requests_listed` (a request the scheduler holds for it and misses there has ended,
    its end lost on the way).
    """

    worker_id: str
    time: float  # wall clock, time.time()
    status: WorkerStatus
    capacity: WorkerCapacity
    epoch: int  # start time in ns, as in KvEventBatch
    kv_event_seq: int = -1  # -1: none published yet
    model: str = ""
    tokenizer_id: str = ""
    requests: list[HeldRequest] = msgspec.field(default_factory=list)
    requests_listed: bool = False


class WorkerStats(Message, frozen=True):
    """worker -> scheduler (and metrics), about once a second: its load.

    Names follow the Prometheus metrics (`num_running_reqs`, `token_usage`, ...).
    The scheduler reads `free_kv_tokens + evictable_kv_tokens` as room for new work.
    """

    worker_id: str
    time: float
    num_running_reqs: int
    num_queue_reqs: int
    free_kv_tokens: int
    evictable_kv_tokens: int = 0
    total_kv_tokens: int = 0
    token_usage: float = 0.0  # in-use share of the KV pool, 0..1
    cache_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, recent window
    gen_throughput: float = 0.0  # generated tokens per second


class ServiceHeartbeat(Message, frozen=True):
    """any service instance -> `{p}.alive.{service}.{instance_id}`, every couple of seconds.

    What `radixserve health` and `radixserve up` read to tell which services are up.
    `status` is "ready" while taking work, "draining" after SIGTERM, and "standby" for a
    scheduler replica that waits for the lease (`--ha-lease`).
    """

    service: str
    instance_id: str
    time: float  # wall clock, time.time()
    status: str = "ready"
    pid: int = 0
    host: str = ""
