"""Cache-aware routing: the KV-event mirrors of the workers' radix caches (event order,
gaps, snapshots, restarts), the prefix match against brute force, the router's
decisions, and the `Dispatcher` wiring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.protocol import (
    AllBlocksCleared,
    Heartbeat,
    KvEvent,
    KvEventBatch,
    OffloadedBlocks,
    RemovedBlocks,
    RestoredBlocks,
    SamplingParams,
    StoredBlocks,
    TokenizedRequest,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
    block_hashes,
    pack_tokens,
)
from radixserve.routing import (
    CacheAwareRouter,
    Dispatcher,
    KvMirrors,
    PromptHashes,
    Routed,
    WorkerLoad,
)
from radixserve.routing import kv_mirror as kv_mirror_module

BS = 4  # block size of most tests
PROMPT = list(range(100, 116))  # 16 tokens: 4 blocks of BS
OTHER = list(range(200, 216))


def _capacity(block_size: int = BS) -> WorkerCapacity:
    return WorkerCapacity(
        max_running_requests=8,
        max_total_num_tokens=4096,
        max_context_len=512,
        kv_block_size=block_size,
    )


def _beat(
    worker_id: str = "w0", epoch: int = 1, kv_event_seq: int = -1, block_size: int = BS
) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        time=0.0,
        status=WorkerStatus.READY,
        capacity=_capacity(block_size),
        epoch=epoch,
        kv_event_seq=kv_event_seq,
    )


def _store(tokens: Sequence[int], block_size: int = BS, skip_blocks: int = 0) -> StoredBlocks:
    """The blocks of `tokens` after the first `skip_blocks` (already cached), as a chain."""
    hashes = block_hashes(tokens, block_size)
    start = skip_blocks * block_size
    return StoredBlocks(
        block_hashes=hashes[skip_blocks:],
        token_ids=pack_tokens(tokens[start : len(hashes) * block_size]),
        block_size=block_size,
        parent_hash=hashes[skip_blocks - 1] if skip_blocks else None,
    )


def _batch(seq: int, *events: KvEvent, worker_id: str = "w0", epoch: int = 1) -> KvEventBatch:
    return KvEventBatch(worker_id=worker_id, epoch=epoch, seq=seq, events=list(events))


def _matched(mirrors: KvMirrors, tokens: Sequence[int], worker_id: str = "w0") -> int:
    return mirrors.matched_tokens(worker_id, PromptHashes(tokens))


def _request(tokens: Sequence[int], rid: str = "r") -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid, gateway_id="gw", input_ids=pack_tokens(tokens), sampling=SamplingParams()
    )


# -- the event stream --------------------------------------------------------------------


def test_in_order_batches_apply_and_a_duplicate_is_ignored() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat())
    mirrors.on_events(_batch(0, _store(PROMPT)))
    assert _matched(mirrors, PROMPT) == 16
    evict_tail = RemovedBlocks(block_hashes=block_hashes(PROMPT, BS)[:1:-1])  # blocks 3, 2
    mirrors.on_events(_batch(1, evict_tail))
    assert _matched(mirrors, PROMPT) == 8
    mirrors.on_events(_batch(0, _store(PROMPT)))  # seen already: must not re-store
    mirror = mirrors.get("w0")
    assert mirror is not None
    assert (mirror.seq, len(mirror.blocks), mirror.stale) == (1, 2, False)
    assert _matched(mirrors, PROMPT) == 8


def test_a_gap_goes_stale_until_a_snapshot_resyncs() -> None:
    mirrors = KvMirrors(snapshot_retry_s=5.0)
    mirrors.on_heartbeat(_beat())
    mirrors.on_events(_batch(0, _store(PROMPT)))
    mirrors.on_events(_batch(2, _store(OTHER)))  # batch 1 was lost
    mirror = mirrors.get("w0")
    assert mirror is not None and mirror.stale and mirror.seq == 0
    assert _matched(mirrors, PROMPT) == 0  # a stale mirror matches nothing
    assert _matched(mirrors, OTHER) == 0 and len(mirror.blocks) == 4  # batch 2 not applied
    mirrors.on_events(_batch(3, _store(OTHER)))  # still a gap: not applied either
    assert mirror.seq == 0

    assert mirrors.snapshots_due(now=10.0) == ["w0"]
    assert mirrors.snapshots_due(now=14.9) == []  # asked already; wait for the answer
    assert mirrors.snapshots_due(now=15.0) == ["w0"]  # no answer within the retry: ask again

    snapshot = _batch(4, AllBlocksCleared(), _store(OTHER), _store(PROMPT[:8]))
    mirrors.on_events(snapshot)
    assert not mirror.stale and mirror.seq == 4
    assert mirror.blocks == set(block_hashes(OTHER, BS)) | set(block_hashes(PROMPT[:8], BS))
    assert (_matched(mirrors, PROMPT), _matched(mirrors, OTHER)) == (8, 16)
    assert mirrors.snapshots_due(now=15.5) == []
    mirrors.on_events(snapshot)  # the same batch again (reply and stream): ignored
    mirrors.on_events(_batch(5, RemovedBlocks(block_hashes=block_hashes(OTHER, BS)[::-1])))
    assert (_matched(mirrors, PROMPT), _matched(mirrors, OTHER)) == (8, 0)

    mirrors.on_events(_batch(7))  # stale again: asked at once, not after the old request
    assert mirrors.snapshots_due(now=16.0) == ["w0"]


def test_a_flush_resyncs_a_stale_mirror_without_a_snapshot() -> None:
    mirrors = KvMirrors()
    mirrors.on_events(_batch(0, _store(PROMPT)))
    mirrors.on_events(_batch(3))  # gap
    assert mirrors.snapshots_due(now=0.0) == ["w0"]
    mirrors.on_events(_batch(4, AllBlocksCleared(), _store(OTHER[:4])))
    assert (_matched(mirrors, PROMPT), _matched(mirrors, OTHER)) == (0, 4)


def test_a_new_epoch_resets_the_mirror_and_the_old_epoch_is_ignored() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat(epoch=1))
    mirrors.on_events(_batch(0, _store(PROMPT), epoch=1))
    mirrors.on_events(_batch(1, _store(OTHER), epoch=1))

    # The restarted process's first batch, seq 0, states its whole (empty-based) cache.
    mirrors.on_events(_batch(0, _store(OTHER[:8]), epoch=2))
    mirror = mirrors.get("w0")
    assert mirror is not None
    assert (mirror.epoch, mirror.seq, mirror.stale, mirror.block_size) == (2, 0, False, BS)
    assert (_matched(mirrors, PROMPT), _matched(mirrors, OTHER)) == (0, 8)
    mirrors.on_events(_batch(1, _store(PROMPT), epoch=1))  # late, from the old process
    assert (mirror.seq, mirror.stale, _matched(mirrors, PROMPT)) == (0, False, 0)
    assert mirrors.get("w0") is mirror

    # Seen mid-stream: what it holds is unknown.
    mirrors.on_events(_batch(5, _store(PROMPT), epoch=3))
    mirror = mirrors.get("w0")
    assert mirror is not None
    assert (mirror.epoch, mirror.seq, mirror.stale, mirror.blocks) == (3, -1, True, set())
    # Starting with AllBlocksCleared, a new epoch's batch is complete wherever it falls.
    mirrors.on_events(_batch(9, AllBlocksCleared(), _store(PROMPT), epoch=4))
    mirror = mirrors.get("w0")
    assert mirror is not None and (mirror.epoch, mirror.seq, mirror.stale) == (4, 9, False)
    assert _matched(mirrors, PROMPT) == 16


@pytest.mark.parametrize(
    ("first", "stale"),
    [
        (_batch(0, _store(PROMPT)), False),
        (_batch(3, _store(PROMPT)), True),
        (_batch(3, AllBlocksCleared(), _store(PROMPT)), False),
    ],
)
def test_a_worker_first_seen_through_its_events(first: KvEventBatch, stale: bool) -> None:
    mirrors = KvMirrors()
    mirrors.on_events(first)
    mirror = mirrors.get("w0")
    assert mirror is not None and mirror.stale is stale
    assert _matched(mirrors, PROMPT) == (0 if stale else 16)
    assert mirrors.snapshots_due(now=0.0) == (["w0"] if stale else [])


def test_heartbeats_learn_the_block_size_and_whether_batches_were_missed() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat("fresh", kv_event_seq=-1, block_size=8))
    mirrors.on_heartbeat(_beat("busy", kv_event_seq=4))  # published batches we never saw
    fresh, busy = mirrors.get("fresh"), mirrors.get("busy")
    assert fresh is not None and busy is not None
    assert (fresh.block_size, fresh.stale, fresh.seq) == (8, False, -1)
    assert (busy.block_size, busy.stale, busy.seq) == (BS, True, -1)
    assert mirrors.snapshots_due(now=0.0) == ["busy"]


def test_a_batch_announced_by_two_heartbeats_in_a_row_is_lost() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat(kv_event_seq=-1))
    mirrors.on_events(_batch(0, _store(PROMPT)))
    mirrors.on_heartbeat(_beat(kv_event_seq=1))  # once ahead: batch 1 may be in flight
    mirror = mirrors.get("w0")
    assert mirror is not None and not mirror.stale
    mirrors.on_heartbeat(_beat(kv_event_seq=1))  # a heartbeat later it still has not come
    assert mirror.stale and _matched(mirrors, PROMPT) == 0


def test_a_busy_worker_always_ahead_by_batches_in_flight_stays_fresh() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat(kv_event_seq=-1))
    for seq in range(5):
        mirrors.on_heartbeat(_beat(kv_event_seq=seq))  # overtakes batch `seq` each time
        mirrors.on_events(_batch(seq, _store(PROMPT[: 4 * (seq % 4 + 1)])))
    mirror = mirrors.get("w0")
    assert mirror is not None and not mirror.stale and mirror.seq == 4
    assert _matched(mirrors, PROMPT) == 16


def test_a_restart_seen_by_heartbeat_empties_the_mirror() -> None:
    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat(epoch=1))
    mirrors.on_events(_batch(0, _store(PROMPT), epoch=1))
    mirrors.on_heartbeat(_beat(epoch=2, kv_event_seq=-1))
    mirror = mirrors.get("w0")
    assert mirror is not None
    assert (mirror.epoch, mirror.seq, mirror.stale, mirror.blocks) == (2, -1, False, set())
    mirrors.on_heartbeat(_beat(epoch=1, kv_event_seq=7))  # a late beat of the old process
    assert (mirror.epoch, mirror.stale, mirror.announced_seq) == (2, False, -1)
    mirrors.on_events(_batch(0, _store(OTHER), epoch=2))
    assert _matched(mirrors, OTHER) == 16 and _matched(mirrors, PROMPT) == 0


def test_a_dropped_worker_is_forgotten() -> None:
    mirrors = KvMirrors()
    mirrors.on_events(_batch(2, _store(PROMPT)))  # stale
    mirrors.drop("w0")
    mirrors.drop("never-seen")
    assert "w0" not in mirrors and len(mirrors) == 0
    assert mirrors.snapshots_due(now=0.0) == []
    assert _matched(mirrors, PROMPT) == 0
    with pytest.raises(ValueError, match="snapshot_retry_s"):
        KvMirrors(snapshot_retry_s=0)


# -- prefix matching ---------------------------------------------------------------------


def _brute_force_blocks(hashes: Sequence[int], cached: set[int]) -> int:
    """The longest i such that all of the first i hashes are cached."""
    i = 0
    while i < len(hashes) and hashes[i] in cached:
        i += 1
    return i


def test_the_match_is_the_longest_cached_prefix_in_whole_blocks() -> None:
    mirrors = KvMirrors()
    mirrors.on_events(_batch(0, _store(PROMPT[:12])))
    assert _matched(mirrors, PROMPT) == 12
    assert _matched(mirrors, PROMPT[:11]) == 8  # the partial tail block is never matched
    diverging = [*PROMPT[:8], 7, 7, 7, 7, *PROMPT[12:]]
    assert _matched(mirrors, diverging) == 8
    assert _matched(mirrors, PROMPT[4:]) == 0  # same tokens, other prefix: other hashes
    assert _matched(mirrors, []) == 0


def test_hashes_are_computed_once_per_block_size_and_not_for_empty_mirrors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def counting(tokens: Sequence[int], block_size: int) -> list[int]:
        calls.append(block_size)
        return block_hashes(tokens, block_size)

    monkeypatch.setattr(kv_mirror_module, "block_hashes", counting)
    mirrors = KvMirrors()
    for worker_id, block_size in [("a", 4), ("b", 4), ("c", 8), ("empty", 2)]:
        mirrors.on_heartbeat(_beat(worker_id, block_size=block_size))
        if worker_id != "empty":
            mirrors.on_events(_batch(0, _store(PROMPT, block_size), worker_id=worker_id))
    prompt = PromptHashes(PROMPT)
    matched = [mirrors.matched_tokens(w, prompt) for w in ("a", "b", "c", "empty", "unknown")]
    assert matched == [16, 16, 16, 0, 0]
    assert sorted(calls) == [4, 8]


@dataclass(frozen=True)
class _Store:
    tokens: list[int]


@dataclass(frozen=True)
class _Evict:
    pick: int  # which leaf, modulo the number of leaves
    count: int  # up to this many blocks, a leaf at a time


_TOKENS = st.lists(st.integers(0, 2), max_size=13)  # few distinct ids: prompts share prefixes
_OPS = st.lists(
    st.one_of(
        st.builds(_Store, _TOKENS),
        st.builds(_Evict, st.integers(0, 10**6), st.integers(1, 4)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3]), ops=_OPS, queries=st.lists(_TOKENS, max_size=6))
def test_binary_search_agrees_with_brute_force_over_random_stores_and_evictions(
    block_size: int, ops: list[_Store | _Evict], queries: list[list[int]]
) -> None:
    """A model worker caches token prefixes (whole blocks), stores chains under what it
    holds and evicts leaves first; the mirror, fed its events, must hold exactly its
    blocks and match every prompt as brute force and the model do."""
    cached: set[tuple[int, ...]] = set()  # the model cache: token prefixes of whole blocks

    def digest(prefix: tuple[int, ...]) -> int:
        return block_hashes(prefix, block_size)[-1]

    def held_blocks(tokens: Sequence[int]) -> int:
        n = 0
        while (n + 1) * block_size <= len(tokens):
            if tuple(tokens[: (n + 1) * block_size]) not in cached:
                break
            n += 1
        return n

    def leaves() -> list[tuple[int, ...]]:
        parents = {p[:-block_size] for p in cached}
        return sorted(cached - parents)

    mirrors = KvMirrors()
    mirrors.on_heartbeat(_beat(block_size=block_size))
    for seq, op in enumerate(ops):
        event: KvEvent
        if isinstance(op, _Store):
            event = _store(op.tokens, block_size, skip_blocks=held_blocks(op.tokens))
            whole = len(op.tokens) // block_size
            cached.update(tuple(op.tokens[: i * block_size]) for i in range(1, whole + 1))
        else:
            removed: list[int] = []
            for _ in range(op.count):
                if not cached:
                    break
                candidates = leaves()
                leaf = candidates[op.pick % len(candidates)]
                cached.discard(leaf)
                removed.append(digest(leaf))
            event = RemovedBlocks(block_hashes=removed)
        mirrors.on_events(_batch(seq, event))

    mirror = mirrors.get("w0")
    assert mirror is not None and not mirror.stale
    assert mirror.blocks == {digest(p) for p in cached}
    for tokens in queries + [list(p) for p in cached]:
        expected = _brute_force_blocks(block_hashes(tokens, block_size), mirror.blocks)
        assert expected == held_blocks(tokens)
        assert _matched(mirrors, tokens) == expected * block_size


# -- the router --------------------------------------------------------------------------


def _mirrors_holding(**held: Sequence[int]) -> KvMirrors:
    """Fresh mirrors (block size BS) of workers each holding one prompt prefix (from
    events only: a routed prompt is not expected anywhere, so each pick stands alone)."""
    mirrors = KvMirrors(expected_ttl_s=0)
    for worker_id, tokens in held.items():
        mirrors.on_heartbeat(_beat(worker_id))
        if tokens:
            mirrors.on_events(_batch(0, _store(tokens), worker_id=worker_id))
    return mirrors


def _pick(router: CacheAwareRouter, tokens: Sequence[int], *loads: WorkerLoad) -> tuple[str, int]:
    route = router.pick(_request(tokens), list(loads))
    assert route is not None
    return route.worker_id, route.expected_cached_tokens


def test_the_worker_holding_the_prefix_wins_while_loads_are_balanced() -> None:
    router = CacheAwareRouter(_mirrors_holding(w0=OTHER, w1=PROMPT[:12]))
    loads = (WorkerLoad("w0", 0, 0), WorkerLoad("w1", 30, 4))
    assert _pick(router, PROMPT, *loads) == ("w1", 12)
    assert _pick(router, OTHER, *loads) == ("w0", 16)
    # Far apart in absolute terms but within 1.5x: still balanced.
    assert _pick(router, PROMPT, WorkerLoad("w0", 100, 0), WorkerLoad("w1", 140, 0)) == ("w1", 12)


def test_imbalanced_loads_go_to_the_least_loaded_worker() -> None:
    router = CacheAwareRouter(_mirrors_holding(w0=PROMPT[:4], w1=PROMPT))
    # 33 more and more than 1.5x: the least loaded, with what it holds as the expectation.
    assert _pick(router, PROMPT, WorkerLoad("w0", 0, 0), WorkerLoad("w1", 33, 0)) == ("w0", 4)
    assert _pick(router, PROMPT, WorkerLoad("w0", 0, 0), WorkerLoad("w1", 32, 0)) == ("w1", 16)
    loose = CacheAwareRouter(router.mirrors, balance_abs_threshold=100)
    assert _pick(loose, PROMPT, WorkerLoad("w0", 0, 0), WorkerLoad("w1", 33, 0)) == ("w1", 16)


def test_a_match_below_the_cache_threshold_goes_to_the_least_loaded_worker() -> None:
    router = CacheAwareRouter(_mirrors_holding(w0=[], w1=PROMPT[:4]))  # w1 holds 25%
    assert _pick(router, PROMPT, WorkerLoad("w0", 1, 0), WorkerLoad("w1", 2, 0)) == ("w0", 0)
    assert _pick(router, PROMPT, WorkerLoad("w0", 3, 0), WorkerLoad("w1", 2, 0)) == ("w1", 4)
    assert _pick(router, PROMPT[:8], WorkerLoad("w0", 1, 0), WorkerLoad("w1", 2, 0)) == ("w1", 4)
    eager = CacheAwareRouter(router.mirrors, cache_threshold=0.25)
    assert _pick(eager, PROMPT, WorkerLoad("w0", 1, 0), WorkerLoad("w1", 2, 0)) == ("w1", 4)


def test_a_stale_mirror_counts_as_holding_nothing() -> None:
    mirrors = _mirrors_holding(w0=[], w1=PROMPT)
    router = CacheAwareRouter(mirrors)
    loads = (WorkerLoad("w0", 1, 0), WorkerLoad("w1", 2, 0))
    assert _pick(router, PROMPT, *loads) == ("w1", 16)
    mirrors.on_events(_batch(5, worker_id="w1"))  # a gap
    assert _pick(router, PROMPT, *loads) == ("w0", 0)


def test_equal_matches_go_to_lower_load_then_fewer_in_flight_then_lower_id() -> None:
    router = CacheAwareRouter(_mirrors_holding(a=PROMPT, b=PROMPT, c=PROMPT, d=[]))
    idle = WorkerLoad("d", 0, 0)  # holds nothing: loses although least loaded
    assert _pick(router, PROMPT, WorkerLoad("c", 2, 5), WorkerLoad("b", 3, 0), idle)[0] == "c"
    assert _pick(router, PROMPT, WorkerLoad("c", 3, 1), WorkerLoad("b", 3, 0), idle)[0] == "b"
    assert _pick(router, PROMPT, WorkerLoad("c", 3, 0), WorkerLoad("a", 3, 0), idle)[0] == "a"
    assert router.pick(_request(PROMPT), []) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"cache_threshold": -0.1}, "cache_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.9}, "balance_rel_threshold"),
    ],
)
def test_bad_router_thresholds_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheAwareRouter(KvMirrors(), **kwargs)  # type: ignore[arg-type]


# -- the dispatcher ----------------------------------------------------------------------


def _dispatcher(routing: str = "cache_aware", *workers: str) -> Dispatcher:
    d = Dispatcher(
        max_pending_requests=100, worker_timeout_s=5.0, retry_after_s=1.0, routing=routing
    )
    for worker_id in workers:
        d.on_heartbeat(_beat(worker_id), now=0.0)
    return d


def _stats(worker_id: str, running: int) -> WorkerStats:
    return WorkerStats(
        worker_id=worker_id, time=0.0, num_running_reqs=running, num_queue_reqs=0, free_kv_tokens=1
    )


def _route(d: Dispatcher, tokens: Sequence[int], rid: str, now: float = 0.0) -> tuple[str, int]:
    decision = d.admit(_request(tokens, rid), now, 0.0)
    assert isinstance(decision, Routed), decision
    return decision.routed.worker_id, decision.routed.expected_cached_tokens


def test_the_dispatcher_routes_by_the_events_it_was_given() -> None:
    d = _dispatcher("cache_aware", "w0", "w1")
    d.on_stats(_stats("w1", running=3), now=0.0)
    d.on_kv_events(_batch(0, _store(PROMPT), worker_id="w1"))
    assert _route(d, PROMPT, "r1") == ("w1", 16)
    assert _route(d, OTHER, "r2") == ("w0", 0)
    # A snapshot is due for a worker whose heartbeat announces batches never received.
    d.on_heartbeat(_beat("w0", kv_event_seq=0), now=1.0)
    d.on_heartbeat(_beat("w0", kv_event_seq=0), now=2.0)
    assert d.kv_snapshots_due(now=2.0) == ["w0"]


def test_an_expired_worker_loses_its_mirror_and_its_late_events_are_ignored() -> None:
    d = _dispatcher("cache_aware", "w0", "w1")
    d.on_kv_events(_batch(0, _store(PROMPT), worker_id="w0"))
    d.on_heartbeat(_beat("w1"), now=4.0)
    assert d.kv_mirrors is not None and "w0" in d.kv_mirrors
    d.expire(now=5.5)
    assert "w0" not in d.kv_mirrors and "w1" in d.kv_mirrors
    d.on_kv_events(_batch(1, _store(OTHER), worker_id="w0"))
    assert "w0" not in d.kv_mirrors and d.kv_snapshots_due(now=6.0) == []


def test_least_load_routing_ignores_kv_events() -> None:
    d = _dispatcher("least_load", "w0", "w1")
    d.on_stats(_stats("w1", running=3), now=0.0)
    d.on_kv_events(_batch(0, _store(PROMPT), worker_id="w1"))
    d.on_kv_events(_batch(9, worker_id="w0"))
    assert d.kv_mirrors is None and d.kv_snapshots_due(now=0.0) == []
    assert _route(d, PROMPT, "r1") == ("w0", 0)


def test_a_given_cache_aware_router_gets_the_events_and_bad_routing_is_refused() -> None:
    router = CacheAwareRouter(KvMirrors(), cache_threshold=1.0)
    d = Dispatcher(max_pending_requests=10, worker_timeout_s=5.0, retry_after_s=1.0, router=router)
    assert d.kv_mirrors is router.mirrors
    for worker_id in ("w0", "w1"):
        d.on_heartbeat(_beat(worker_id), now=0.0)
    d.on_kv_events(_batch(0, _store(PROMPT[:12]), worker_id="w1"))
    assert _route(d, PROMPT, "r1") == ("w0", 0)  # 75% < the threshold of 100%
    assert _route(d, PROMPT[:12], "r2") == ("w1", 12)
    with pytest.raises(ValueError, match="routing must be one of"):
        _dispatcher("round_robin")


# -- prompts expected where they were routed, before their events come ---------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fresh(clock: _Clock, *workers: str, ttl_s: float = 30.0) -> KvMirrors:
    mirrors = KvMirrors(expected_ttl_s=ttl_s, clock=clock)
    for worker_id in workers:
        mirrors.on_heartbeat(_beat(worker_id))
    return mirrors


def test_a_burst_sharing_a_new_prefix_follows_its_first_request() -> None:
    """No worker has cached the prompt yet (no events): the first request goes by load,
    and the ones right behind it follow it, while loads stay balanced."""
    clock = _Clock()
    router = CacheAwareRouter(_fresh(clock, "w0", "w1"))
    assert _pick(router, PROMPT, WorkerLoad("w0", 0, 0), WorkerLoad("w1", 0, 0)) == ("w0", 0)
    for load in range(1, 4):  # w0 busier each time, by less than the balance threshold
        question = [*PROMPT, load, load, load, load]  # the same prefix, its own question
        assert _pick(router, question, WorkerLoad("w0", load, 0), WorkerLoad("w1", 0, 0)) == (
            "w0",
            len(PROMPT),
        )
    # Another prompt still goes by load.
    assert _pick(router, OTHER, WorkerLoad("w0", 3, 0), WorkerLoad("w1", 0, 0)) == ("w1", 0)


def test_an_expectation_lapses_after_its_ttl_and_events_replace_it() -> None:
    clock = _Clock()
    mirrors = _fresh(clock, "w0", "w1", ttl_s=10.0)
    router = CacheAwareRouter(mirrors)
    busy = (WorkerLoad("w0", 2, 0), WorkerLoad("w1", 0, 0))
    mirrors.note_routed("w0", PromptHashes(PROMPT))
    assert _pick(router, PROMPT, *busy)[0] == "w0"
    clock.now += 10.5  # no event came: the request may have failed
    mirrors.snapshots_due(clock.now)  # the scheduler's periodic pass drops lapsed ones
    w0 = mirrors.get("w0")
    assert w0 is not None and not w0.expected
    assert _pick(router, PROMPT, *busy)[0] == "w1"
    # w1 now expects it; its events confirm it, and outlast the TTL.
    mirrors.on_events(_batch(0, _store(PROMPT), worker_id="w1"))
    w1 = mirrors.get("w1")
    assert w1 is not None and not w1.expected
    clock.now += 100
    assert mirrors.matched_tokens("w1", PromptHashes(PROMPT)) == len(PROMPT)
    # An eviction removes a block whether stored or expected; a clear removes all.
    mirrors.note_routed("w0", PromptHashes(OTHER))
    mirrors.on_events(_batch(0, RemovedBlocks(block_hashes(OTHER, BS)[-1:]), worker_id="w0"))
    assert mirrors.matched_tokens("w0", PromptHashes(OTHER)) == len(OTHER) - BS
    mirrors.on_events(_batch(1, AllBlocksCleared(), worker_id="w0"))
    assert mirrors.matched_tokens("w0", PromptHashes(OTHER)) == 0


def test_nothing_is_expected_of_a_stale_mirror() -> None:
    clock = _Clock()
    mirrors = KvMirrors(clock=clock)
    mirrors.on_heartbeat(_beat("w0", kv_event_seq=3))  # batches this scheduler never saw
    mirrors.note_routed("w0", PromptHashes(PROMPT))
    w0 = mirrors.get("w0")
    assert w0 is not None and w0.stale and not w0.expected
    assert mirrors.matched_tokens("w0", PromptHashes(PROMPT)) == 0
    with pytest.raises(ValueError, match="expected_ttl_s"):
        KvMirrors(expected_ttl_s=-1)


# -- HiCache's tiers: offloaded blocks ----------------------------------------------------


def test_offloaded_blocks_still_match_and_count_apart_until_restored() -> None:
    mirrors = _mirrors_holding(w0=PROMPT)
    hashes = block_hashes(PROMPT, BS)
    mirrors.on_events(_batch(1, OffloadedBlocks(hashes[2:]), OffloadedBlocks([12345])))
    prompt = PromptHashes(PROMPT)
    assert mirrors.matched_tokens("w0", prompt) == 16
    assert mirrors.matched_device_tokens("w0", prompt) == 8
    mirror = mirrors.get("w0")
    assert mirror is not None and 12345 not in mirror.offloaded  # never stored: ignored
    mirrors.on_events(_batch(2, RestoredBlocks(hashes[2:3])))
    assert mirrors.matched_device_tokens("w0", prompt) == 12
    mirrors.on_events(_batch(3, RemovedBlocks(hashes[3:])))
    assert mirrors.matched_tokens("w0", prompt) == 12
    assert mirror.offloaded == set()
    mirrors.on_events(_batch(4, OffloadedBlocks(hashes), AllBlocksCleared()))
    assert mirror.offloaded == set() and mirrors.matched_tokens("w0", prompt) == 0


def test_a_prefix_on_the_device_beats_the_same_prefix_in_host_memory() -> None:
    mirrors = _mirrors_holding(w0=PROMPT, w1=PROMPT[:12])
    mirrors.on_events(_batch(1, OffloadedBlocks(block_hashes(PROMPT, BS)), worker_id="w0"))
    router = CacheAwareRouter(mirrors)
    loads = (WorkerLoad("w0", 0, 0), WorkerLoad("w1", 0, 0))
    # w0: 16 tokens in host memory (worth 8), w1: 12 on the device.
    assert _pick(router, PROMPT, *loads) == ("w1", 12)
    mirrors.on_events(_batch(1, RemovedBlocks(block_hashes(PROMPT, BS)[1:]), worker_id="w1"))
    # w1 now holds 4 on the device: w0's 16 in host memory are worth more.
    assert _pick(router, PROMPT, *loads) == ("w0", 16)
