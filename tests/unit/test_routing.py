"""radixserve.routing: least-load choice, liveness, backpressure, aborts and the
accounting of finished requests, driven through the `Dispatcher` the scheduler uses."""

from __future__ import annotations

import msgspec
import pytest

from radixserve.protocol import (
    FinishReason,
    FlushCacheReply,
    Heartbeat,
    HeldRequest,
    RequestError,
    RoutedRequest,
    SamplingParams,
    StepOutput,
    StepOutputBatch,
    TokenizedRequest,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
    decode,
    encode,
    pack_tokens,
)
from radixserve.routing import (
    NO_WORKER,
    QUEUE_FULL,
    REQUEST_LOST,
    UNLISTED_AFTER_S,
    WORKER_LOST,
    ChoiceProgress,
    Dispatcher,
    Dropped,
    InflightEntry,
    InflightTable,
    LeastLoadRouter,
    RecentAborts,
    Rejected,
    Routed,
    WorkerLoad,
    merge_flush_replies,
    step_progress,
)

CAPACITY = WorkerCapacity(max_running_requests=8, max_total_num_tokens=4096, max_context_len=512)
TIMEOUT_S = 5.0


def _beat(worker_id: str, status: WorkerStatus = WorkerStatus.READY, epoch: int = 1) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, time=0.0, status=status, capacity=CAPACITY, epoch=epoch)


def _stats(worker_id: str, running: int, queued: int = 0, at: float = 0.0) -> WorkerStats:
    return WorkerStats(
        worker_id=worker_id,
        time=at,
        num_running_reqs=running,
        num_queue_reqs=queued,
        free_kv_tokens=1000,
    )


def _request(rid: str, n: int = 1, gateway_id: str = "gw-1") -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        gateway_id=gateway_id,
        input_ids=pack_tokens([1, 2, 3]),
        sampling=SamplingParams(n=n),
    )


def _dispatcher(max_pending: int = 100, *workers: str, max_migrations: int = 2) -> Dispatcher:
    # Least-load decisions: the requests here repeat one prompt, which cache-aware routing
    # (tests/unit/test_routing_cache_aware.py) would keep on one worker.
    dispatcher = Dispatcher(
        max_pending_requests=max_pending,
        worker_timeout_s=TIMEOUT_S,
        retry_after_s=2.0,
        routing="least_load",
        max_migrations=max_migrations,
    )
    for worker_id in workers:
        dispatcher.on_heartbeat(_beat(worker_id), now=0.0)
    return dispatcher


def _routed_to(decision: object) -> str:
    assert isinstance(decision, Routed), decision
    return decision.routed.worker_id


def _rejected(decision: object) -> RequestError:
    assert isinstance(decision, Rejected), decision
    return decision.error


def test_least_loaded_worker_wins_counting_what_was_routed_since_its_stats() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w0", running=2, queued=1), now=0.0)  # load 3
    d.on_stats(_stats("w1", running=1), now=0.0)  # load 1
    first = d.admit(_request("r1"), now=0.1, wall_time=1000.0)
    assert _routed_to(first) == "w1"
    assert isinstance(first, Routed)
    assert first.routed.request == _request("r1")
    assert first.routed.routed_at == 1000.0
    assert _routed_to(d.admit(_request("r2"), 0.1, 0.0)) == "w1"  # w1: 1 + 1 routed = 2 < 3
    # Now both have load 3; the tie goes to the fewest in flight (w0: 0, w1: 2).
    assert _routed_to(d.admit(_request("r3"), 0.1, 0.0)) == "w0"
    # A fresh report replaces the estimate: w1 says it is idle again.
    d.on_stats(_stats("w1", running=0, at=1.0), now=0.2)
    assert _routed_to(d.admit(_request("r4"), 0.2, 0.0)) == "w1"
    # A report older than the one held is ignored.
    d.on_stats(_stats("w1", running=50, at=0.5), now=0.3)
    w1 = d.workers.get("w1")
    assert w1 is not None and w1.load == 1


def test_ties_on_load_and_in_flight_go_to_the_lowest_id() -> None:
    router = LeastLoadRouter()
    loads = [WorkerLoad("w2", 1, 0), WorkerLoad("w1", 1, 0), WorkerLoad("w3", 1, 1)]
    route = router.pick(_request("r"), loads)
    assert route is not None and route.worker_id == "w1"
    assert router.pick(_request("r"), []) is None


@pytest.mark.parametrize(
    "status", [WorkerStatus.STARTING, WorkerStatus.DRAINING, WorkerStatus.STOPPING]
)
def test_a_worker_that_is_not_ready_gets_no_new_work(status: WorkerStatus) -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=9), now=0.0)
    d.on_heartbeat(_beat("w0", status), now=0.5)
    assert _routed_to(d.admit(_request("r1"), 0.5, 0.0)) == "w1"
    assert d.ready_workers() == ["w1"]


def test_stats_before_the_first_heartbeat_are_kept_but_not_routable() -> None:
    d = _dispatcher(100)
    d.on_stats(_stats("w0", running=4), now=0.0)
    assert _rejected(d.admit(_request("r0"), 0.0, 0.0)).code == NO_WORKER
    d.on_heartbeat(_beat("w0"), now=0.1)
    d.on_heartbeat(_beat("w1"), now=0.1)
    assert _routed_to(d.admit(_request("r1"), 0.1, 0.0)) == "w1"  # w0 still has load 4


def test_no_ready_worker_is_a_503_with_retry_after() -> None:
    d = _dispatcher(100)
    error = _rejected(d.admit(_request("r1", gateway_id="gw-9"), 0.0, 0.0))
    assert (error.rid, error.http_status, error.code, error.retry_after_s) == (
        "r1",
        503,
        NO_WORKER,
        2.0,
    )
    assert len(d.inflight) == 0


def test_a_silent_worker_expires_and_its_requests_are_lost() -> None:
    d = _dispatcher(100, "w0", "w1", max_migrations=0)  # no re-routes: 503s
    d.on_stats(_stats("w1", running=5), now=0.0)
    assert _routed_to(d.admit(_request("r1", gateway_id="gw-a"), 0.0, 0.0)) == "w0"
    assert _routed_to(d.admit(_request("r2", gateway_id="gw-b"), 0.0, 0.0)) == "w0"
    assert _routed_to(d.admit(_request("r3"), 0.0, 0.0)) == "w0"
    d.on_finished("r3", 0, "stop")
    d.on_heartbeat(_beat("w1"), now=4.0)  # w1 stays alive, w0 goes silent after t=0
    assert d.expire(now=TIMEOUT_S) == []  # exactly the timeout: not yet
    lost = d.expire(now=TIMEOUT_S + 0.01)
    assert sorted((r.gateway_id, r.error.rid) for r in lost) == [("gw-a", "r1"), ("gw-b", "r2")]
    for rejected in lost:
        error = rejected.error
        assert (error.http_status, error.code, error.retry_after_s) == (503, WORKER_LOST, 2.0)
        assert "w0" in error.message
    assert "w0" not in d.workers and len(d.inflight) == 0
    assert _routed_to(d.admit(_request("r4"), TIMEOUT_S + 0.1, 0.0)) == "w1"
    later = d.expire(now=4.0 + TIMEOUT_S + 0.01)  # now w1 went silent too
    assert [(r.gateway_id, r.error.rid, r.error.code) for r in later] == [
        ("gw-1", "r4", WORKER_LOST)
    ]
    assert _rejected(d.admit(_request("r5"), 10.0, 0.0)).code == NO_WORKER


def test_a_restarted_worker_loses_what_it_held() -> None:
    d = _dispatcher(100, "w0")
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    assert d.on_heartbeat(_beat("w0", epoch=1), now=1.0) == []  # same process
    lost = d.on_heartbeat(_beat("w0", epoch=2), now=2.0)
    assert [(r.error.rid, r.error.code) for r in lost] == [("r1", WORKER_LOST)]
    assert "restarted" in lost[0].error.message
    assert _routed_to(d.admit(_request("r2"), 2.0, 0.0)) == "w0"


def test_more_than_the_bound_is_a_429_until_one_finishes() -> None:
    d = _dispatcher(2, "w0")
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    assert _routed_to(d.admit(_request("r2"), 0.0, 0.0)) == "w0"
    error = _rejected(d.admit(_request("r3"), 0.0, 0.0))
    assert (error.rid, error.http_status, error.code, error.retry_after_s) == (
        "r3",
        429,
        QUEUE_FULL,
        2.0,
    )
    assert d.on_finished("r1", 0, "length")
    assert _routed_to(d.admit(_request("r3"), 0.0, 0.0)) == "w0"
    # A request the worker refused ends with an error to its gateway: that frees it too.
    assert d.on_error("r2") == "w0"
    assert d.on_error("r2") is None
    assert _routed_to(d.admit(_request("r4"), 0.0, 0.0)) == "w0"


def test_a_request_that_never_reached_its_worker_frees_its_place_with_a_503() -> None:
    d = _dispatcher(1, "w0")
    assert _routed_to(d.admit(_request("r1", gateway_id="gw-7"), 0.0, 0.0)) == "w0"
    lost = d.unroute("r1", "the request could not be sent to worker w0")
    assert lost is not None
    assert lost.gateway_id == "gw-7"
    assert (lost.error.rid, lost.error.http_status, lost.error.code) == ("r1", 503, WORKER_LOST)
    assert "could not be sent to worker w0" in lost.error.message
    assert d.unroute("r1", "again") is None  # no longer in flight
    assert d.abort("r1", 0.0) is None
    assert _routed_to(d.admit(_request("r2"), 0.0, 0.0)) == "w0"  # its place is free
    # Past the bus's payload limit: a 413 without a retry hint.
    big = d.unroute("r2", "not sent", too_large=True)
    assert big is not None
    assert (big.error.http_status, big.error.code, big.error.retry_after_s) == (
        413,
        "request_too_large",
        None,
    )


def test_an_abort_is_forwarded_to_the_worker_holding_the_request() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w0", running=3), now=0.0)
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w1"
    assert d.abort("r1", now=0.1) == "w1"
    assert "r1" in d.inflight  # until the worker's final (abort) output arrives
    assert d.on_finished("r1", 0, "abort")
    assert d.abort("r1", now=0.2) is None  # finished: nothing to forward


def test_an_abort_that_overtakes_its_request_drops_it() -> None:
    d = _dispatcher(100, "w0")
    assert d.abort("r1", now=0.0) is None
    dropped = d.admit(_request("r1"), now=1.0, wall_time=0.0)
    assert isinstance(dropped, Dropped)
    assert len(d.inflight) == 0
    # Remembered once: a later request with another rid is routed as usual.
    assert _routed_to(d.admit(_request("r2"), 1.0, 0.0)) == "w0"


def test_early_aborts_are_forgotten_after_their_ttl_and_bounded_in_number() -> None:
    aborts = RecentAborts(ttl_s=10.0, max_entries=3)
    aborts.add("a", now=0.0)
    assert not aborts.consume("a", now=10.5)  # expired
    for i, rid in enumerate(["b", "c", "d", "e"]):
        aborts.add(rid, now=float(i))
    assert len(aborts) == 3 and "b" not in aborts  # the oldest made room
    aborts.prune(now=12.5)  # c (expires 11) and d (12) are gone, e (13) stays
    assert "c" not in aborts and "d" not in aborts and "e" in aborts


def test_n_choices_finish_the_request_only_when_all_have_finished() -> None:
    d = _dispatcher(1, "w0")
    assert _routed_to(d.admit(_request("r1", n=3), 0.0, 0.0)) == "w0"
    assert not d.on_finished("r1", 0, "stop")
    assert not d.on_finished("r1", 0, "stop")  # a repeated finish of one choice counts once
    assert not d.on_finished("r1", 2, "length")
    assert _rejected(d.admit(_request("r2"), 0.0, 0.0)).code == QUEUE_FULL
    assert d.on_finished("r1", 1, "stop")
    assert _routed_to(d.admit(_request("r2", n=4), 0.0, 0.0)) == "w0"
    assert d.on_finished("r2", 1, "abort")  # an abort ends every choice


def test_a_duplicate_rid_is_not_routed_twice() -> None:
    d = _dispatcher(100, "w0")
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    assert isinstance(d.admit(_request("r1"), 0.0, 0.0), Dropped)
    assert len(d.inflight) == 1


def test_step_progress_reads_an_encoded_step_batch() -> None:
    batch = StepOutputBatch(
        worker_id="w0",
        step=7,
        outputs=[
            StepOutput(rid="a", gateway_id="g", new_token_ids=pack_tokens([5, 6])),
            StepOutput(
                rid="b",
                gateway_id="g",
                index=1,
                new_token_ids=pack_tokens([9]),
                token_logprobs=[-0.5],
                finish_reason=FinishReason(kind="stop", matched=2),
            ),
            StepOutput(rid="c", gateway_id="g", finish_reason=FinishReason(kind="abort")),
        ],
    )
    progress = step_progress(encode(batch))
    assert [(p.rid, p.index, p.finish) for p in progress] == [
        ("a", 0, None),
        ("b", 1, "stop"),
        ("c", 0, "abort"),
    ]
    assert [p.new_token_ids for p in progress] == [pack_tokens([5, 6]), pack_tokens([9]), b""]


def test_flush_is_ok_only_when_every_worker_said_ok() -> None:
    ok = FlushCacheReply(rid="f", ok=True, worker_id="w0")
    refused = FlushCacheReply(rid="f", ok=False, worker_id="w1", message="requests running")
    assert merge_flush_replies("f", {"w0": ok, "w1": ok}).ok
    mixed = merge_flush_replies("f", {"w0": ok, "w1": refused, "w2": "no reply within 5s"})
    assert not mixed.ok and mixed.rid == "f"
    assert mixed.message == "w1: requests running; w2: no reply within 5s"
    assert not merge_flush_replies("f", {}).ok


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Dispatcher(max_pending_requests=0, worker_timeout_s=1.0, retry_after_s=1.0)
    with pytest.raises(ValueError):
        Dispatcher(max_pending_requests=1, worker_timeout_s=0.0, retry_after_s=1.0)


def test_pending_acks_expire_in_send_order_and_late_acks_are_ignored() -> None:
    from radixserve.routing import PendingAcks

    acks = PendingAcks(timeout_s=2.0)
    first = acks.sent("r1", "w0", now=10.0)
    second = acks.sent("r2", "w1", now=11.0)
    third = acks.sent("r3", "w0", now=11.5)
    assert len({first, second, third}) == 3 and len(acks) == 3
    assert acks.acked(second) == ("r2", "w1")
    assert acks.expired(now=11.9) == []
    assert acks.expired(now=12.0) == [("r1", "w0")]  # the deadline itself counts
    assert acks.acked(first) is None  # too late: already answered as lost
    assert acks.acked("unknown") is None
    assert acks.expired(now=20.0) == [("r3", "w0")] and len(acks) == 0
    with pytest.raises(ValueError, match="ack timeout"):
        PendingAcks(timeout_s=0)


def test_the_inflight_table_remembers_when_its_last_requests_ended() -> None:
    now = [100.0]
    table = InflightTable(max_ended=2, clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        table.add(InflightEntry(rid=rid, worker_id="w0", gateway_id="gw", choices=1, routed_at=0))
    assert table.ended_ago("a") is None  # in flight
    table.finish_choice("a", 0)
    now[0] = 103.0
    assert table.ended_ago("a") == 3.0
    table.remove("b")
    table.take_worker("w0")  # c: its worker was lost
    assert table.ended_ago("a") is None  # only the last two are remembered
    assert (table.ended_ago("b"), table.ended_ago("c")) == (0.0, 0.0)
    assert table.ended_ago("never") is None


# -- a dead worker's requests go on elsewhere -------------------------------------------


def _progress(
    rid: str, ids: list[int], total: int, finish: str | None = None, index: int = 0
) -> ChoiceProgress:
    return ChoiceProgress(rid, index, pack_tokens(ids), total, finish)  # type: ignore[arg-type]


def test_a_lost_workers_request_is_rerouted_with_what_it_generated() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=5), 0.0)  # w0 takes the first request
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    d.on_progress(_progress("r1", [7, 8], 2))
    d.on_progress(_progress("r1", [9], 3))
    d.on_heartbeat(_beat("w1"), now=TIMEOUT_S)  # w1 stays alive, w0 goes silent
    (moved,) = d.expire(TIMEOUT_S + 0.1)
    assert isinstance(moved, Routed) and moved.migrated == "worker_lost"
    routed = moved.routed
    assert (routed.worker_id, routed.attempt) == ("w1", 1)
    assert routed.output_prefix == pack_tokens([7, 8, 9])
    assert routed.request.input_ids == pack_tokens([1, 2, 3])  # the prompt as it was
    assert d.inflight.count_on("w1") == 1 and d.abort("r1", 0.0) == "w1"
    # Its outputs from the new worker continue the count; the finish ends it.
    d.on_progress(_progress("r1", [10], 4))
    assert d.on_progress(_progress("r1", [11], 5, "length"))
    assert "r1" not in d.inflight


def test_a_restarted_workers_requests_go_to_another_worker() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=5), 0.0)
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    (moved,) = d.on_heartbeat(_beat("w0", epoch=2), now=1.0)
    assert isinstance(moved, Routed) and moved.migrated == "worker_restarted"
    assert moved.routed.worker_id == "w1" and moved.routed.output_prefix is None


def test_what_cannot_be_rerouted_gets_worker_lost() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=50), 0.0)
    for rid, n in (("holes", 2), ("hole", 1), ("ok", 1)):
        assert _routed_to(d.admit(_request(rid, n=n), 0.0, 0.0)) == "w0"
    d.on_progress(_progress("hole", [7], 1))
    d.on_progress(_progress("hole", [9], 3))  # token 2 never seen: cannot resume exactly
    d.on_progress(_progress("holes", [7], 1))
    d.on_progress(_progress("holes", [5], 2, index=1))  # choice 1's first token never seen
    d.on_progress(_progress("holes", [8], 2))  # choice 0 whole: the request still cannot go
    d.on_heartbeat(_beat("w1"), now=TIMEOUT_S)
    decisions = {
        (m.routed.rid if isinstance(m, Routed) else m.error.rid): m
        for m in d.expire(TIMEOUT_S + 0.1)
    }
    assert isinstance(decisions["ok"], Routed)
    for rid in ("holes", "hole"):
        lost = decisions[rid]
        assert isinstance(lost, Rejected) and lost.error.code == WORKER_LOST
        assert rid not in d.inflight


def test_an_n_choice_request_goes_on_with_each_choices_tokens() -> None:
    # Three choices on w0: 0 finishes there, 1 and 2 are cut at different counts. Each
    # re-route carries every unfinished choice's own tokens, and None for finished ones.
    d = _dispatcher(100, "w0", "w1", "w2")
    d.on_stats(_stats("w1", running=5), 0.0)
    d.on_stats(_stats("w2", running=9), 0.0)
    assert _routed_to(d.admit(_request("r", n=3), 0.0, 0.0)) == "w0"
    d.on_progress(_progress("r", [1, 2], 2, index=0))
    d.on_progress(_progress("r", [4], 1, index=1))
    assert not d.on_progress(_progress("r", [3], 3, "stop", index=0))
    d.on_progress(_progress("r", [5, 6], 3, index=1))
    d.on_progress(_progress("r", [7], 1, index=2))
    entry = d.inflight.get("r")
    assert entry is not None
    assert entry.prefixes() == [None, pack_tokens([4, 5, 6]), pack_tokens([7])]
    for worker in ("w1", "w2"):
        d.on_heartbeat(_beat(worker), now=TIMEOUT_S)
    (moved,) = d.expire(TIMEOUT_S + 0.1)
    assert isinstance(moved, Routed) and moved.migrated == "worker_lost"
    routed = decode(encode(moved.routed), RoutedRequest)  # as the worker reads it
    assert (routed.worker_id, routed.attempt, routed.output_prefix) == ("w1", 1, None)
    assert routed.choice_prefixes == [None, pack_tokens([4, 5, 6]), pack_tokens([7])]
    # w1 continues each choice's own count; choice 1 finishes, then w1 is lost too.
    d.on_progress(_progress("r", [8], 4, "length", index=1))
    d.on_progress(_progress("r", [9, 10], 3, index=2))
    (again,) = d.on_heartbeat(_beat("w1", epoch=2), now=TIMEOUT_S + 1)
    assert isinstance(again, Routed) and again.routed.worker_id == "w2"
    assert again.routed.attempt == 2
    assert again.routed.choice_prefixes == [None, None, pack_tokens([7, 9, 10])]
    assert d.on_progress(_progress("r", [11], 4, "length", index=2))  # the last choice
    assert "r" not in d.inflight


def test_a_request_whose_choices_all_finished_is_not_rerouted() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=5), 0.0)
    assert _routed_to(d.admit(_request("done", n=2), 0.0, 0.0)) == "w0"
    assert _routed_to(d.admit(_request("half", n=2), 0.0, 0.0)) == "w0"
    assert not d.on_progress(_progress("done", [1], 1, "stop", index=1))
    assert d.on_progress(_progress("done", [2, 3], 2, "length", index=0))
    assert not d.on_progress(_progress("half", [4], 1, "stop", index=0))
    d.on_heartbeat(_beat("w1"), now=TIMEOUT_S)
    (moved,) = d.expire(TIMEOUT_S + 0.1)  # "done" left the table at its last finish
    assert isinstance(moved, Routed) and moved.routed.rid == "half"
    assert moved.routed.choice_prefixes == [None, b""]  # choice 1 had no token yet
    assert "done" not in d.inflight and d.inflight.ended_ago("done") is not None


def test_a_routed_request_says_its_choices_prefixes_consistently() -> None:
    request = _request("r", n=2)
    ok = RoutedRequest(request=request, worker_id="w", choice_prefixes=[None, pack_tokens([1])])
    assert decode(encode(ok), RoutedRequest) == ok
    # A first route (or a scheduler of before n > 1 migrations) sends no such field.
    first = encode(RoutedRequest(request=request, worker_id="w"))
    assert "choice_prefixes" not in msgspec.msgpack.decode(first)
    assert decode(first, RoutedRequest).choice_prefixes is None
    for prefixes, prefix, why in (
        ([None], None, "for n = 2 choices, got 1"),
        ([None, None], None, "no choice to run"),
        ([b"", b"\x01"], None, "packed"),
        ([b"", None], pack_tokens([1]), "not both"),
    ):
        with pytest.raises(ValueError, match=why):
            RoutedRequest(
                request=request, worker_id="w", choice_prefixes=prefixes, output_prefix=prefix
            )


def test_reroutes_are_bounded_and_need_another_worker() -> None:
    d = Dispatcher(
        max_pending_requests=10, worker_timeout_s=TIMEOUT_S, retry_after_s=1.0,
        routing="least_load", max_migrations=1,
    )  # fmt: skip
    for worker in ("w0", "w1"):
        d.on_heartbeat(_beat(worker), now=0.0)
    d.on_stats(_stats("w1", running=5), 0.0)
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    (first,) = d.on_heartbeat(_beat("w0", epoch=2), now=1.0)
    assert isinstance(first, Routed) and first.routed.worker_id == "w1"
    (second,) = d.on_heartbeat(_beat("w1", epoch=2), now=1.0)  # a second loss: past the bound
    assert isinstance(second, Rejected) and second.error.code == WORKER_LOST
    # One worker only: nowhere to go.
    alone = _dispatcher(100, "w0")
    assert _routed_to(alone.admit(_request("r2"), 0.0, 0.0)) == "w0"
    (lost,) = alone.on_heartbeat(_beat("w0", epoch=2), now=1.0)
    assert isinstance(lost, Rejected)


def test_a_run_not_taken_goes_to_another_worker() -> None:
    d = _dispatcher(100, "w0", "w1")
    d.on_stats(_stats("w1", running=5), 0.0)
    assert _routed_to(d.admit(_request("r1"), 0.0, 0.0)) == "w0"
    moved = d.not_taken("r1", "w0", "w0 does not listen")
    assert isinstance(moved, Routed) and moved.migrated == "not_acknowledged"
    assert moved.routed.worker_id == "w1"
    assert d.not_taken("r1", "w0", "late") is None  # not w0's any more


def test_a_restarted_scheduler_adopts_what_the_workers_run() -> None:
    # A new scheduler hears w0 run r1 (2 choices) and r2: aborts reach them, the bound
    # counts them, and their finishes end them; what it saw end is not adopted again.
    d = _dispatcher(100, "w0")
    held = [HeldRequest(rid="r1", gateway_id="gw-a", choices=2), HeldRequest("r2", "gw-b")]
    d.on_finished("r2", 0, "stop")  # unknown here: nothing happens
    beat = Heartbeat(
        worker_id="w0", time=0.0, status=WorkerStatus.READY, capacity=CAPACITY, epoch=1,
        requests=held,
    )  # fmt: skip
    assert d.on_heartbeat(beat, now=1.0) == []
    assert d.abort("r1", 1.0) == "w0" and d.abort("r2", 1.0) == "w0"
    assert len(d.inflight) == 2 and d.inflight.count_on("w0") == 2
    assert not d.on_finished("r1", 0, "stop")
    assert d.on_finished("r1", 1, "stop")  # both choices: over
    assert d.on_finished("r2", 0, "length")
    d.on_heartbeat(beat, now=2.0)  # a heartbeat sent before those finishes
    assert len(d.inflight) == 0


def test_a_request_its_worker_no_longer_lists_gets_request_lost() -> None:
    # Its worker ended it but the end never came (lost in a NATS outage): failed once two
    # heartbeats UNLISTED_AFTER_S apart miss it, not left to wait for its deadline.
    d = _dispatcher(100, "w0")
    for rid in ("gone", "runs", "back"):
        assert _routed_to(d.admit(_request(rid), 0.0, 0.0)) == "w0"

    def beat(*rids: str, listed: bool = True) -> Heartbeat:
        return Heartbeat(
            worker_id="w0", time=0.0, status=WorkerStatus.READY, capacity=CAPACITY, epoch=1,
            requests=[HeldRequest(rid, "gw") for rid in rids], requests_listed=listed,
        )  # fmt: skip

    assert d.on_heartbeat(beat("gone", "runs", "back"), now=1.0) == []
    assert d.on_heartbeat(beat("runs"), now=2.0) == []  # maybe its end is on its way
    assert d.on_heartbeat(beat("runs", "back"), now=3.0) == []  # listed again: forgiven
    assert d.on_heartbeat(beat("runs", listed=False), now=10.0) == []  # not a full list
    (lost,) = d.on_heartbeat(beat("runs"), now=2.0 + UNLISTED_AFTER_S)
    assert isinstance(lost, Rejected) and lost.error.rid == "gone"
    assert lost.error.code == REQUEST_LOST and lost.error.http_status == 503
    assert "gone" not in d.inflight and "runs" in d.inflight and "back" in d.inflight
