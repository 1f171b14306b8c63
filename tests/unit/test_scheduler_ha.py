"""Active/standby schedulers: the `--ha-lease` settings, and the dispatcher's standby half
(worker state kept, no requests adopted) and hand-over. The lease itself runs against a
real Redis in tests/integration/test_lease.py; failover of service processes in
tests/integration/test_scheduler_failover_stack.py."""

from __future__ import annotations

import argparse

import pytest

from radixserve.protocol import (
    Heartbeat,
    HeldRequest,
    SamplingParams,
    TokenizedRequest,
    WorkerCapacity,
    WorkerStatus,
    pack_tokens,
)
from radixserve.routing import Dispatcher, Routed
from radixserve.services import scheduler
from radixserve.services.runtime import add_common_arguments

CAPACITY = WorkerCapacity(max_running_requests=8, max_total_num_tokens=4096, max_context_len=512)


def settings(argv: list[str]) -> scheduler.SchedulerSettings:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    scheduler.add_arguments(parser)
    return scheduler.settings_from(parser.parse_args(argv))


def test_the_lease_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(scheduler.ENV_HA_LEASE, raising=False)
    monkeypatch.delenv(scheduler.ENV_HA_LEASE_TTL_S, raising=False)
    assert settings([]).ha_lease_ttl_s is None
    assert settings(["--ha-lease"]).ha_lease_ttl_s == scheduler.DEFAULT_HA_LEASE_TTL_S
    assert settings(["--ha-lease", "--ha-lease-ttl-s", "2"]).ha_lease_ttl_s == 2.0
    monkeypatch.setenv(scheduler.ENV_HA_LEASE, "true")
    monkeypatch.setenv(scheduler.ENV_HA_LEASE_TTL_S, "4.5")
    assert settings([]).ha_lease_ttl_s == 4.5
    assert settings(["--no-ha-lease"]).ha_lease_ttl_s is None


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["--ha-lease", "--ha-lease-ttl-s", "0.1"], {}, "--ha-lease-ttl-s"),
        ([], {scheduler.ENV_HA_LEASE: "maybe"}, scheduler.ENV_HA_LEASE),
        (["--ha-lease"], {scheduler.ENV_HA_LEASE_TTL_S: "soon"}, scheduler.ENV_HA_LEASE_TTL_S),
    ],
)
def test_bad_lease_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], match: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        settings(argv)


def beat(worker_id: str, *rids: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        time=0.0,
        status=WorkerStatus.READY,
        capacity=CAPACITY,
        epoch=1,
        requests=[HeldRequest(rid=rid, gateway_id="gw-1") for rid in rids],
        requests_listed=True,
    )


def request(rid: str) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid, gateway_id="gw-1", input_ids=pack_tokens([1, 2, 3]), sampling=SamplingParams()
    )


def dispatcher() -> Dispatcher:
    return Dispatcher(max_pending_requests=10, worker_timeout_s=5.0, retry_after_s=1.0)


def test_a_standby_knows_the_workers_but_holds_none_of_their_requests() -> None:
    standby = dispatcher()
    standby.observe_heartbeat(beat("w0", "r1", "r2"), now=0.0)
    assert standby.ready_workers() == ["w0"]
    assert len(standby.inflight) == 0
    # Its dead workers go too, with nothing to fail.
    assert standby.expire(now=10.0) == []
    assert standby.ready_workers() == []


def test_a_standby_taking_over_adopts_from_the_next_heartbeats_and_routes() -> None:
    d = dispatcher()
    d.observe_heartbeat(beat("w0", "r1"), now=0.0)
    assert d.on_heartbeat(beat("w0", "r1"), now=1.0) == []  # active now
    assert "r1" in d.inflight and d.abort("r1", now=1.0) == "w0"
    decision = d.admit(request("r2"), now=1.0, wall_time=0.0)
    assert isinstance(decision, Routed) and decision.routed.worker_id == "w0"


def test_a_scheduler_stepping_down_hands_its_requests_over() -> None:
    d = dispatcher()
    d.on_heartbeat(beat("w0"), now=0.0)
    assert isinstance(d.admit(request("r1"), now=0.0, wall_time=0.0), Routed)
    d.hand_over()
    assert len(d.inflight) == 0 and d.inflight.ended_ago("r1") is None
    assert d.ready_workers() == ["w0"]  # the worker state stays warm
    # Nothing of r1 is failed here when its worker goes: the new active one has it.
    assert d.expire(now=10.0) == []
