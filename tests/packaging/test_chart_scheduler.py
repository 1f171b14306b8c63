"""The chart's schedulers: active/standby replicas over the Redis lease by default (rolled,
with the Redis user's password), one recreated instance without `scheduler.haLease`
(and no Redis secret); the arguments the chart passes parse as the scheduler's own."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from radixserve.services import scheduler
from radixserve.services.runtime import add_common_arguments
from tests.packaging.kube import CHART_DIR, by_kind, component_of, render_chart


def scheduler_deployment(values: dict[str, Any] | None = None) -> dict[str, Any]:
    deployments = by_kind(render_chart(CHART_DIR, values), "Deployment").values()
    (found,) = [d for d in deployments if component_of(d) == "scheduler"]
    return found


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def parsed(args: list[str]) -> scheduler.SchedulerSettings:
    assert args[:2] == ["serve", "scheduler"]
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    scheduler.add_arguments(parser)
    return scheduler.settings_from(parser.parse_args(args[2:]))


def env_names(deployment: dict[str, Any]) -> set[str]:
    return {item["name"] for item in container(deployment).get("env", [])}


def test_by_default_two_schedulers_share_the_lease_and_roll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(scheduler.ENV_HA_LEASE, raising=False)
    deployment = scheduler_deployment()
    assert deployment["spec"]["replicas"] == 2
    # A standby takes over on SIGTERM: an upgrade rolls, one new pod first.
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert parsed(container(deployment)["args"]).ha_lease_ttl_s == 3.0
    assert {"RADIXSERVE_REDIS_USER", "RADIXSERVE_REDIS_PASSWORD_FILE"} <= env_names(deployment)


def test_without_the_lease_one_scheduler_is_recreated_without_redis_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(scheduler.ENV_HA_LEASE, raising=False)
    deployment = scheduler_deployment({"scheduler": {"haLease": False, "replicas": 1}})
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert parsed(container(deployment)["args"]).ha_lease_ttl_s is None
    assert not {name for name in env_names(deployment) if name.startswith("RADIXSERVE_REDIS_")}
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert "redis-auth" not in {volume["name"] for volume in volumes}


def test_the_lease_ttl_reaches_the_scheduler() -> None:
    deployment = scheduler_deployment({"scheduler": {"haLeaseTtlS": 5}})
    assert parsed(container(deployment)["args"]).ha_lease_ttl_s == 5.0
