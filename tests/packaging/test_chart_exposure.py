"""charts/radixserve, secure by default: API keys on unless switched off on purpose, the
Ingress's paths, who the NetworkPolicies let reach each port, the Services that stay in
the cluster, the scraped ports; and proof that a policy or an Ingress opened too wide
makes these checks fail."""

from __future__ import annotations

import base64
import posixpath
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import HelmError

from radixserve.auth.keyfile import read_keys
from radixserve.auth.keys import hash_key
from tests.packaging.chart_values import SERVICES, VALUE_SETS
from tests.packaging.kube import (
    CHART_DIR,
    RELEASE,
    Manifest,
    by_kind,
    chart_copy,
    component_of,
    edit_file,
    env_values,
    ingress_sources,
    pod_ports,
    pod_specs,
    render_chart,
    render_notes,
)

CLIENT_PATHS = [("/v1", "Prefix"), ("/generate", "Exact"), ("/health", "Prefix")]


def ingress_paths(manifests: list[Manifest]) -> dict[str, list[tuple[str, str]]]:
    """host -> (path, pathType) the Ingress routes to the gateway's API port."""
    (ingress,) = by_kind(manifests, "Ingress").values()
    routes: dict[str, list[tuple[str, str]]] = {}
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend == {"name": "rs-radixserve-gateway", "port": {"name": "http"}}
            routes.setdefault(rule["host"], []).append((path["path"], path["pathType"]))
    return routes


def test_ingress_routes_only_the_client_paths(rendered: dict[str, list[Manifest]]) -> None:
    hosts = [{"host": "a.example"}, {"host": "b.example"}]
    two = render_chart(CHART_DIR, {"ingress": {"enabled": True, "hosts": hosts}})
    assert ingress_paths(rendered["all-features"]) == {"radixserve.local": CLIENT_PATHS}
    assert ingress_paths(two) == {"a.example": CLIENT_PATHS, "b.example": CLIENT_PATHS}


def test_ingress_paths_are_not_a_setting() -> None:
    """A values file of the chart before (`paths: [{path: /}]`, i.e. /metrics and
    /flush_cache too) is refused, not quietly narrowed."""
    old = {"ingress": {"enabled": True, "hosts": [{"host": "h", "paths": [{"path": "/"}]}]}}
    with pytest.raises(HelmError, match="schema"):
        render_chart(CHART_DIR, old)


def _gateway_pod(manifests: list[Manifest]) -> dict[str, Any]:
    pod: dict[str, Any] = by_kind(manifests, "Deployment")["rs-radixserve-gateway"]["spec"][
        "template"
    ]["spec"]
    return pod


def _keys_volume(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(RADIXSERVE_API_KEYS_FILE, the secret volume mounted on its folder)."""
    container = pod["containers"][0]
    keys_file = env_values(container)["RADIXSERVE_API_KEYS_FILE"]
    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == posixpath.dirname(keys_file)
    ]
    assert mount["readOnly"] is True and "subPath" not in mount  # updates reach the gateway
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = posixpath.basename(keys_file)
    # Only the hashed file: the admin key's clear text stays in the Secret.
    assert volume["secret"]["items"] == [{"key": "api-keys.json", "path": name}]
    return keys_file, volume["secret"]


def test_auth_is_on_by_default(rendered: dict[str, list[Manifest]], tmp_path: Path) -> None:
    """The gateway reads a keys file from the generated Secret, whose one key is the
    hash of the admin key beside it, as the gateway's own parser reads it."""
    for values in VALUE_SETS:
        manifests = rendered[values]
        pod = _gateway_pod(manifests)
        _, secret_volume = _keys_volume(pod)
        assert "RADIXSERVE_ALLOW_UNAUTHENTICATED" not in env_values(pod["containers"][0])
        secret = by_kind(manifests, "Secret")[secret_volume["secretName"]]
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        assert set(data) == {"admin-api-key", "api-keys.json"}
        key = data["admin-api-key"]
        assert key.startswith("rsk-") and len(key) == len("rsk-") + 43, key  # 256 random bits
        path = tmp_path / f"{values}.json"
        path.write_text(data["api-keys.json"])
        (admin,) = read_keys(path)
        assert admin.name == "admin" and admin.sha256 == hash_key(key)
        assert admin.scopes == {"inference", "admin", "metrics"}
        assert (admin.rpm, admin.tpm, admin.priority) == (None, None, None)
    keys = {
        by_kind(rendered[v], "Secret")["rs-radixserve-api-keys"]["data"]["admin-api-key"]
        for v in VALUE_SETS
    }
    assert len(keys) == len(VALUE_SETS)  # random: no key shipped in the chart
    notes = render_notes(CHART_DIR)
    assert (
        "kubectl -n llm get secret rs-radixserve-api-keys -o jsonpath='{.data.admin-api-key}'"
        " | base64 -d" in notes
    )


def test_an_existing_secret_replaces_the_generated_one() -> None:
    values = {"auth": {"existingSecret": "my-keys"}}
    manifests = render_chart(CHART_DIR, values)
    _, secret_volume = _keys_volume(_gateway_pod(manifests))
    assert secret_volume["secretName"] == "my-keys"
    assert "rs-radixserve-api-keys" not in by_kind(manifests, "Secret")
    notes = render_notes(CHART_DIR, values)
    assert "my-keys" in notes and "admin-api-key" not in notes


def test_no_keys_needs_an_explicit_allow_unauthenticated() -> None:
    with pytest.raises(HelmError, match=r"auth\.allowUnauthenticated"):
        render_chart(CHART_DIR, {"auth": {"enabled": False}})
    values = {"auth": {"enabled": False, "allowUnauthenticated": True}}
    manifests = render_chart(CHART_DIR, values)
    container = _gateway_pod(manifests)["containers"][0]
    assert env_values(container)["RADIXSERVE_ALLOW_UNAUTHENTICATED"] == "true"
    assert "RADIXSERVE_API_KEYS_FILE" not in env_values(container)
    assert "rs-radixserve-api-keys" not in by_kind(manifests, "Secret")
    assert "API keys are OFF" in render_notes(CHART_DIR, values)


def test_prometheus_scrapes_the_metrics_ports_not_the_api(
    rendered: dict[str, list[Manifest]],
) -> None:
    manifests = rendered["all-features"]
    (monitor,) = by_kind(manifests, "ServiceMonitor").values()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    services = by_kind(manifests, "Service")
    gateway = _gateway_pod(manifests)["containers"][0]
    metrics_port = int(env_values(gateway)["RADIXSERVE_METRICS_PORT"])
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in gateway["ports"]
    scraped = services["rs-radixserve-gateway-metrics"]["spec"]
    assert scraped["clusterIP"] == "None"
    assert scraped["ports"] == [
        {"name": "metrics", "port": metrics_port, "targetPort": "metrics", "protocol": "TCP"}
    ]
    # The Service clients use (maybe a LoadBalancer) carries the API port only.
    assert [p["name"] for p in services["rs-radixserve-gateway"]["spec"]["ports"]] == ["http"]
    for deployment in by_kind(manifests, "Deployment").values():
        if component_of(deployment) in SERVICES:  # the prometheus.io/* annotations too
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(metrics_port), component_of(deployment)


PROMETHEUS_PODS = [
    {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
]


@pytest.mark.parametrize("values", ["default", "all-features"])
def test_network_policies_open_each_port_to_its_clients_only(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    """NATS and Redis: the stack's service pods only; the gateway's API port: anyone
    (gatewayFrom); the metrics ports and NATS monitoring: Prometheus (metricsFrom)."""
    manifests = rendered[values]
    stack = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "radixserve",
                "app.kubernetes.io/instance": RELEASE,
            },
            "matchExpressions": [
                {"key": "app.kubernetes.io/component", "operator": "In", "values": list(SERVICES)}
            ],
        }
    }
    expected = {
        "client": [[stack]],
        "redis": [[stack]],
        "http": [None],
        "metrics": [PROMETHEUS_PODS],
        "monitor": [PROMETHEUS_PODS],
    }
    seen = set()
    for component, labels, port in pod_ports(manifests):
        assert ingress_sources(manifests, labels, port) == expected[port["name"]], (
            component,
            port,
        )
        seen.add((component, port["name"]))
    assert {
        ("nats", "client"),
        ("redis", "redis"),
        ("gateway", "http"),
        ("gateway", "metrics"),
    } <= seen
    assert {("nats", "monitor"), *((s, "metrics") for s in SERVICES)} <= seen


def test_every_service_is_cluster_internal_but_the_gateways(
    rendered: dict[str, list[Manifest]],
) -> None:
    """Nothing but the gateway's API Service may be a NodePort or LoadBalancer (and it
    only by gateway.service.type): NATS, Redis, every metrics port stay in the cluster."""
    exposed = render_chart(CHART_DIR, {"gateway": {"service": {"type": "LoadBalancer"}}})
    for manifests in (*rendered.values(), exposed):
        for name, service in by_kind(manifests, "Service").items():
            if name != "rs-radixserve-gateway":
                assert service["spec"].get("type", "ClusterIP") == "ClusterIP", name
    assert by_kind(exposed, "Service")["rs-radixserve-gateway"]["spec"]["type"] == "LoadBalancer"


def test_the_chart_sets_no_grafana_password(rendered: dict[str, list[Manifest]]) -> None:
    """The chart ships dashboards for a Grafana of the cluster's, and no Grafana of its
    own: no workload of it, no admin password anywhere in what it renders."""
    for manifests in rendered.values():
        images = [c["image"] for m in manifests for pod in pod_specs(m) for c in pod["containers"]]
        assert not [i for i in images if "grafana" in i or "prometheus" in i or "otel" in i]
        text = yaml.safe_dump_all([m.body for m in manifests])
        assert "GF_SECURITY_ADMIN_PASSWORD" not in text and "admin-password" not in text


def test_network_policy_check_fails_when_metrics_rules_open_the_api(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    edit_file(
        chart / "templates" / "networkpolicy.yaml",
        "        - port: monitor\n",
        "        - port: http\n          protocol: TCP\n        - port: monitor\n",
    )
    manifests = render_chart(chart)
    gateway = [(labels, port) for c, labels, port in pod_ports(manifests) if c == "gateway"]
    labels, http = next((labels, port) for labels, port in gateway if port["name"] == "http")
    assert ingress_sources(manifests, labels, http) == [None, PROMETHEUS_PODS]


def test_ingress_check_fails_on_a_catch_all_path(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    edit_file(chart / "templates" / "ingress.yaml", '"path" "/v1"', '"path" "/"')
    routes = ingress_paths(render_chart(chart, {"ingress": {"enabled": True}}))
    assert routes != {"radixserve.local": CLIENT_PATHS}
