"""Subjects are built from the prefix; wildcards match exactly their concrete subjects."""

from __future__ import annotations

import pytest

import radixserve.protocol as proto
from radixserve.protocol import (
    Subjects,
    subject_matches,
)

# -- subjects ----------------------------------------------------------------------------


def _concrete(s: Subjects, worker: str = "w-0", gateway: str = "gw-0") -> dict[str, str]:
    return {
        "tokenize": s.tokenize,
        "schedule": s.schedule,
        "worker_run": s.worker_run(worker),
        "worker_abort": s.worker_abort(worker),
        "worker_flush_cache": s.worker_flush_cache(worker),
        "worker_kv_snapshot": s.worker_kv_snapshot(worker),
        "abort": s.abort,
        "flush_cache": s.flush_cache,
        "scheduler_inflight": s.scheduler_inflight,
        "detok": s.detok,
        "gateway_deltas": s.gateway_deltas(gateway),
        "gateway_errors": s.gateway_errors(gateway),
        "grammar_compile": s.grammar_compile,
        "grammar_fetch": s.grammar_fetch,
        "kv_events": s.kv_events(worker),
        "stats": s.stats(worker),
        "heartbeat": s.heartbeat(worker),
    }


def test_default_subjects() -> None:
    s = Subjects()
    assert _concrete(s) == {
        "tokenize": "radixserve.tokenize",
        "schedule": "radixserve.schedule",
        "worker_run": "radixserve.worker.w-0.run",
        "worker_abort": "radixserve.worker.w-0.abort",
        "worker_flush_cache": "radixserve.worker.w-0.flush_cache",
        "worker_kv_snapshot": "radixserve.worker.w-0.kv_snapshot",
        "abort": "radixserve.abort",
        "flush_cache": "radixserve.flush_cache",
        "scheduler_inflight": "radixserve.scheduler.inflight",
        "detok": "radixserve.detok",
        "gateway_deltas": "radixserve.gateway.gw-0.deltas",
        "gateway_errors": "radixserve.gateway.gw-0.errors",
        "grammar_compile": "radixserve.grammar.compile",
        "grammar_fetch": "radixserve.grammar.fetch",
        "kv_events": "radixserve.kv_events.w-0",
        "stats": "radixserve.stats.w-0",
        "heartbeat": "radixserve.heartbeat.w-0",
    }


@pytest.mark.parametrize("prefix", ["radixserve", "rs", "prod.eu.rs"])
def test_subjects_are_built_from_the_prefix(prefix: str) -> None:
    s = Subjects(prefix)
    subjects = _concrete(s)
    assert len(set(subjects.values())) == len(subjects)  # no two kinds share a subject
    for subject in subjects.values():
        assert subject.startswith(prefix + ".")
        assert subject_matches(s.everything, subject)
        assert not subject_matches(Subjects("other").everything, subject)


# Which wildcard must match which concrete subject kind; every other pair must not match.
WILDCARDS = {
    "worker_run_all": {"worker_run"},
    "worker_abort_all": {"worker_abort"},
    "gateway_deltas_all": {"gateway_deltas"},
    "gateway_errors_all": {"gateway_errors"},
    "kv_events_all": {"kv_events"},
    "stats_all": {"stats"},
    "heartbeat_all": {"heartbeat"},
}


@pytest.mark.parametrize("prefix", ["radixserve", "prod.eu.rs"])
@pytest.mark.parametrize("ids", [("w-0", "gw-0"), ("worker_7", "7f3a")])
def test_wildcards_match_exactly_their_concrete_subjects(prefix: str, ids: tuple[str, str]) -> None:
    s = Subjects(prefix)
    concrete = _concrete(s, *ids)
    for wildcard_name, kinds in WILDCARDS.items():
        pattern = getattr(s, wildcard_name)
        matched = {kind for kind, subject in concrete.items() if subject_matches(pattern, subject)}
        assert matched == kinds, wildcard_name
    worker_kinds = {k for k, v in concrete.items() if subject_matches(s.worker_all(ids[0]), v)}
    assert worker_kinds == {
        "worker_run",
        "worker_abort",
        "worker_flush_cache",
        "worker_kv_snapshot",
    }
    assert not subject_matches(s.worker_all("someone-else"), s.worker_run(ids[0]))
    gateway_kinds = {k for k, v in concrete.items() if subject_matches(s.gateway_all(ids[1]), v)}
    assert gateway_kinds == {"gateway_deltas", "gateway_errors"}


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.d", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        (">", "a", True),
        ("*", "a.b", False),
        ("*.>", "a.b", True),
    ],
)
def test_subject_matcher_follows_nats_rules(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


def test_matcher_rejects_gt_in_the_middle() -> None:
    with pytest.raises(ValueError, match="last token"):
        subject_matches("a.>.b", "a.x.b")


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "has space", "tab\t", "new\nline"])
def test_ids_that_would_break_a_subject_are_rejected(bad: str) -> None:
    s = Subjects()
    for make in (s.worker_run, s.worker_abort, s.kv_events, s.stats, s.heartbeat, s.gateway_deltas):
        with pytest.raises(ValueError, match="invalid"):
            make(bad)


@pytest.mark.parametrize("bad", ["", ".rs", "rs.", "a..b", "a.*", "a.>", "a b"])
def test_bad_prefix_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Subjects(bad)


def test_id_from_subject() -> None:
    s = Subjects("prod.rs")
    assert s.id_from(s.kv_events("w-9")) == "w-9"
    assert s.id_from(s.heartbeat("w-9")) == "w-9"
    assert s.id_from(s.worker_run("w-9")) == "w-9"
    assert s.id_from(s.gateway_deltas("gw")) == "gw"
    with pytest.raises(ValueError):
        s.id_from(s.tokenize)
    with pytest.raises(ValueError):
        s.id_from(Subjects("other").kv_events("w-9"))


def test_queue_groups_are_distinct_tokens() -> None:
    groups = [proto.QueueGroups.TOKENIZER, proto.QueueGroups.SCHEDULER, proto.QueueGroups.GRAMMAR]
    assert len(set(groups)) == len(groups)
    for group in groups:
        proto.check_token(group)
