"""Every NATS subject and queue group of radixserve, declared once.

Build a `Subjects` from the configured prefix and ask it for subject strings; no
other module formats a subject. `docs/architecture.md` has the table of who
publishes and who subscribes to each one.

Ids that become subject tokens (worker ids, gateway ids) are checked here: a `.`
would split the token and `*`/`>` would turn a publish target into a wildcard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

DEFAULT_PREFIX = "radixserve"

# A NATS token: printable, no whitespace, no `.`, and not a wildcard character.
_TOKEN_RE = re.compile(r"[^\s.*>]+")


class QueueGroups:
    """Queue group names. Subscribers in one group share the messages of a subject.

    The detokenizer has none on purpose: it keeps incremental decoding state per
    request, so every step output of a request must reach the same instance.
    The scheduler runs as one instance; its group (on `schedule`, `abort`,
    `flush_cache`) only keeps a standby replica from handling the same message twice.
    """

    TOKENIZER = "tokenizer"
    SCHEDULER = "scheduler"
    GRAMMAR = "grammar"


def check_token(value: str, what: str = "subject token") -> str:
    """Return `value` if it can be one NATS subject token, else raise ValueError."""
    if not isinstance(value, str) or not _TOKEN_RE.fullmatch(value):
        raise ValueError(
            f"invalid {what} {value!r}: must be non-empty, without whitespace, '.', '*' or '>'"
        )
    return value


def check_prefix(prefix: str) -> str:
    """A prefix is one or more dot-separated tokens, e.g. `radixserve` or `prod.rs`."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"invalid subject prefix {prefix!r}: must be a non-empty string")
    for token in prefix.split("."):
        check_token(token, f"token {token!r} of subject prefix")
    return prefix


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` matches exactly one token, a final `>` one or more."""
    pattern_tokens = pattern.split(".")
    subject_tokens = subject.split(".")
    for i, token in enumerate(pattern_tokens):
        if token == ">":
            if i != len(pattern_tokens) - 1:
                raise ValueError(f"'>' must be the last token of a pattern: {pattern!r}")
            return len(subject_tokens) > i
        if i >= len(subject_tokens):
            return False
        if token != "*" and token != subject_tokens[i]:
            return False
    return len(subject_tokens) == len(pattern_tokens)


@dataclass(frozen=True)
class Subjects:
    """All subjects under one prefix. Cheap; build it once per process from the config."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    def _join(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    # -- the request path --------------------------------------------------------
    @cached_property
    def tokenize(self) -> str:
        """gateway -> tokenizer (queue group): `SubmitRequest`, sent as a request that the
        tokenizer acknowledges on receipt with an empty reply."""
        return self._join("tokenize")

    @cached_property
    def schedule(self) -> str:
        """tokenizer -> scheduler: `TokenizedRequest`, sent as a request that the scheduler
        acknowledges on receipt with an empty reply."""
        return self._join("schedule")

    def worker_run(self, worker_id: str) -> str:
        """scheduler -> one worker: `RoutedRequest`, with a reply subject the worker
        acknowledges on receipt (`scheduler_ack`)."""
        return self._join("worker", check_token(worker_id, "worker id"), "run")

    def scheduler_ack(self, scheduler_id: str, token: str) -> str:
        """worker -> the scheduler that sent a run: an empty acknowledgement."""
        return self._join(
            "scheduler",
            check_token(scheduler_id, "scheduler id"),
            "ack",
            check_token(token, "token"),
        )

    def scheduler_acks(self, scheduler_id: str) -> str:
        """Every acknowledgement addressed to one scheduler (`scheduler_ack`'s wildcard)."""
        return self._join("scheduler", check_token(scheduler_id, "scheduler id"), "ack", "*")

    @cached_property
    def detok(self) -> str:
        """every worker -> detokenizer: `StepOutputBatch` (one per engine step)."""
        return self._join("detok")

    @cached_property
    def detok_resync(self) -> str:
        """detokenizer -> every worker: `DetokResync`; the worker holding a request
        answers with its history in `StepOutputBatch.resent` on `detok`."""
        return self._join("detok_resync")

    def gateway_deltas(self, gateway_id: str) -> str:
        """detokenizer -> the gateway that owns the requests: `TextDeltaBatch`."""
        return self._join("gateway", check_token(gateway_id, "gateway id"), "deltas")

    def gateway_errors(self, gateway_id: str) -> str:
        """any service -> the gateway that owns the request: `RequestError`."""
        return self._join("gateway", check_token(gateway_id, "gateway id"), "errors")

    # -- aborts and control -------------------------------------------------------
    @cached_property
    def abort(self) -> str:
        """gateway -> scheduler: `AbortRequest`."""
        return self._join("abort")

    def worker_abort(self, worker_id: str) -> str:
        """scheduler -> the worker that holds the request: `AbortRequest`."""
        return self._join("worker", check_token(worker_id, "worker id"), "abort")

    @cached_property
    def flush_cache(self) -> str:
        """gateway -> scheduler, request/reply: `FlushCacheRequest` -> `FlushCacheReply`."""
        return self._join("flush_cache")

    @cached_property
    def scheduler_inflight(self) -> str:
        """gateway -> scheduler, request/reply: `InflightQuery` -> `InflightReply`."""
        return self._join("scheduler", "inflight")

    def worker_flush_cache(self, worker_id: str) -> str:
        """scheduler -> one worker, request/reply: `FlushCacheRequest` -> `FlushCacheReply`."""
        return self._join("worker", check_token(worker_id, "worker id"), "flush_cache")

    def worker_kv_snapshot(self, worker_id: str) -> str:
        """scheduler -> one worker: `KvSnapshotRequest`; the answer is the worker's whole
        cache as `KvEventBatch`es on its `kv_events` subject, in sequence."""
        return self._join("worker", check_token(worker_id, "worker id"), "kv_snapshot")

    # -- grammar -------------------------------------------------------------------
    @cached_property
    def grammar_compile(self) -> str:
        """tokenizer -> grammar (queue group), request/reply: `GrammarCompileRequest/Reply`."""
        return self._join("grammar", "compile")

    @cached_property
    def grammar_fetch(self) -> str:
        """worker -> grammar (queue group), request/reply: `GrammarFetchRequest/Reply`."""
        return self._join("grammar", "fetch")

    # -- what workers report ----------------------------------------------------------
    def kv_events(self, worker_id: str) -> str:
        """worker -> scheduler: `KvEventBatch`."""
        return self._join("kv_events", check_token(worker_id, "worker id"))

    def stats(self, worker_id: str) -> str:
        """worker -> scheduler (and anyone watching): `WorkerStats`."""
        return self._join("stats", check_token(worker_id, "worker id"))

    def heartbeat(self, worker_id: str) -> str:
        """worker -> scheduler: `Heartbeat`."""
        return self._join("heartbeat", check_token(worker_id, "worker id"))

    def alive(self, service: str, instance_id: str) -> str:
        """every service instance -> anyone watching (`radixserve health`, `up`): `ServiceHeartbeat`."""
        return self._join(
            "alive", check_token(service, "service name"), check_token(instance_id, "instance id")
        )

    # -- wildcard forms for subscribers -----------------------------------------------
    @cached_property
    def alive_all(self) -> str:
        return self._join("alive", ">")

    @cached_property
    def worker_run_all(self) -> str:
        return self._join("worker", "*", "run")

    @cached_property
    def worker_abort_all(self) -> str:
        return self._join("worker", "*", "abort")

    @cached_property
    def gateway_deltas_all(self) -> str:
        return self._join("gateway", "*", "deltas")

    @cached_property
    def gateway_errors_all(self) -> str:
        return self._join("gateway", "*", "errors")

    @cached_property
    def kv_events_all(self) -> str:
        return self._join("kv_events", "*")

    @cached_property
    def stats_all(self) -> str:
        return self._join("stats", "*")

    @cached_property
    def heartbeat_all(self) -> str:
        return self._join("heartbeat", "*")

    def worker_all(self, worker_id: str) -> str:
        """Every subject addressed to one worker (run, abort, flush, snapshot)."""
        return self._join("worker", check_token(worker_id, "worker id"), ">")

    def gateway_all(self, gateway_id: str) -> str:
        """Every subject addressed to one gateway (deltas, errors)."""
        return self._join("gateway", check_token(gateway_id, "gateway id"), ">")

    @cached_property
    def everything(self) -> str:
        """Every radixserve subject under this prefix (debugging, tracing taps)."""
        return self._join(">")

    # -- parsing ------------------------------------------------------------------------
    def id_from(self, subject: str) -> str:
        """The worker or gateway id in a concrete subject, e.g. `stats.w0` -> `w0`.

        Lets one wildcard subscriber (the scheduler on `kv_events.*`) tell senders apart
        without trusting a field of the body.
        """
        prefix_len = self.prefix.count(".") + 1
        tokens = subject.split(".")
        if tokens[:prefix_len] != self.prefix.split(".") or len(tokens) < prefix_len + 2:
            raise ValueError(f"subject {subject!r} carries no id under prefix {self.prefix!r}")
        kind = tokens[prefix_len]
        if kind in ("worker", "gateway", "kv_events", "stats", "heartbeat"):
            return tokens[prefix_len + 1]
        raise ValueError(f"subject {subject!r} carries no worker or gateway id")
