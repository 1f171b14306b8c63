"""The chart's worker drains within its pod's grace period (issue 56, item 4): the drain
timeout reaches the worker as the variable its settings read, the grace period covers
the drain and the NATS flush after it (each bounded by that timeout), the chart refuses
values where it would not, and no preStop hook spends the grace before the drain."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helm_python import HelmError

from radixserve.services.runtime import ENV_DRAIN_TIMEOUT_S, ServiceSettings
from tests.packaging.kube import (
    CHART_DIR,
    GPU_VALUES,
    by_kind,
    component_of,
    load_values,
    render_chart,
)


def _worker_pod(values: dict[str, Any] | None) -> dict[str, Any]:
    (worker,) = [
        d
        for d in by_kind(render_chart(CHART_DIR, values), "Deployment").values()
        if component_of(d) == "worker"
    ]
    pod: dict[str, Any] = worker["spec"]["template"]["spec"]
    return pod


def _grace_needed(drain_s: float) -> int:
    return 2 * math.ceil(drain_s) + 10


@pytest.mark.parametrize(
    "values",
    [
        None,
        load_values(GPU_VALUES),
        {"worker": {"drainTimeoutS": 45.5, "terminationGracePeriodSeconds": 102}},
    ],
    ids=["default", "gpu", "longer"],
)
def test_the_worker_drains_within_its_grace_period(values: dict[str, Any] | None) -> None:
    pod = _worker_pod(values)
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container.get("env", [])}
    drain_s = ServiceSettings.from_env(
        "worker", {ENV_DRAIN_TIMEOUT_S: env[ENV_DRAIN_TIMEOUT_S]}
    ).drain_timeout_s
    expected = (values or {}).get("worker", {}).get("drainTimeoutS", 20)
    assert drain_s == expected
    assert pod["terminationGracePeriodSeconds"] >= _grace_needed(drain_s)
    assert "preStop" not in container.get("lifecycle", {})


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    short = {"worker": {"drainTimeoutS": 30, "terminationGracePeriodSeconds": 60}}
    with pytest.raises(HelmError, match=r"at least 2 x worker\.drainTimeoutS \+ 10 \(70\)"):
        render_chart(CHART_DIR, short)
    for bad in (0, -1, "soon"):
        with pytest.raises(HelmError, match="schema"):
            render_chart(CHART_DIR, {"worker": {"drainTimeoutS": bad}})
