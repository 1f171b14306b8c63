"""charts/radixserve: helm lint, rendering with the default, GPU and all-features values,
strict schema validation of every object, the container policy on every container, what
is exposed (API keys on by default, the Ingress's paths, who the NetworkPolicies let reach
each port, the scraped ports), and proof that broken values, templates and manifests make
these checks fail."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import posixpath
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import HelmError

from radixserve.auth.keyfile import read_keys
from radixserve.auth.keys import hash_key
from radixserve.bus import Bus, BusAuthError, BusSettings, NatsAuth
from radixserve.engine.config import EngineConfig
from radixserve.engine.flags import engine_kwargs
from radixserve.infra.nats_auth import ADMIN, ROLES, password_variable, render_authorization
from radixserve.infra.redis_acl import DEFAULT_USER, RedisAcl
from radixserve.infra.servers import free_port
from radixserve.protocol.subjects import Subjects
from radixserve.services import worker as worker_service
from radixserve.store import RedisAuth, Store, StoreAuthError, StoreSettings
from tests.packaging.compose_checks import COMPOSE_FILE, variables
from tests.packaging.kube import (
    CHART_DIR,
    GPU_VALUES,
    KUBE_VERSIONS,
    RELEASE,
    Manifest,
    by_kind,
    component_of,
    container_violations,
    ingress_sources,
    lint_errors,
    load_values,
    pod_ports,
    pod_specs,
    render_chart,
    render_notes,
    strict_errors,
)
from tests.packaging.real_servers import nats_server, redis_cli, redis_server

SERVICES = ("gateway", "tokenizer", "scheduler", "grammar", "detokenizer", "worker")
# Everything optional switched on: ingress, HPAs, KEDA, ServiceMonitor, external OTLP,
# a model volume, an explicit context length.
ALL_FEATURES: dict[str, Any] = {
    "config": {"otlpEndpoint": "http://otel-collector.observability:4318", "contextLength": 4096},
    "modelDir": {"existingClaim": "models"},
    "gateway": {"autoscaling": {"enabled": True}},
    "tokenizer": {"autoscaling": {"enabled": True}},
    "worker": {"keda": {"enabled": True}},
    "serviceMonitor": {"enabled": True},
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "tls": [{"hosts": ["radixserve.local"], "secretName": "tls"}],
    },
    "networkPolicy": {
        "otlpTo": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}
        ]
    },
}
EXTERNAL_INFRA: dict[str, Any] = {
    "nats": {"enabled": False, "url": "nats://nats.infra:4223"},
    "redis": {"enabled": False, "url": "redis://redis.infra:6380/0"},
    "natsAuth": {"existingSecret": "nats-users"},
    "redisAuth": {"existingSecret": "redis-user"},
}


def _gpu_values() -> dict[str, Any]:
    return load_values(GPU_VALUES)


VALUE_SETS = {
    "default": lambda: None,
    "gpu": _gpu_values,
    "all-features": lambda: ALL_FEATURES,
    "external-infra": lambda: EXTERNAL_INFRA,
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {name: render_chart(CHART_DIR, make()) for name, make in VALUE_SETS.items()}


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_helm_lint_is_clean(values: str) -> None:
    assert lint_errors(CHART_DIR, VALUE_SETS[values]()) == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", ["default", "gpu"])
def test_rendered_chart_passes_strict_validation(
    rendered: dict[str, list[Manifest]], values: str, version: str
) -> None:
    assert strict_errors(rendered[values], version) == []


@pytest.mark.parametrize("values", ["all-features", "external-infra"])
def test_optional_features_pass_strict_validation(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    assert strict_errors(rendered[values], KUBE_VERSIONS[-1]) == []


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_every_container_is_hardened_and_probed(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    assert container_violations(manifests) == []
    workloads = {**by_kind(manifests, "Deployment"), **by_kind(manifests, "StatefulSet")}
    assert {component_of(w) for w in workloads.values()} >= set(SERVICES)


def test_default_values_deploy_the_whole_stack(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["default"]
    deployments = {component_of(d): d for d in by_kind(manifests, "Deployment").values()}
    assert set(deployments) == {*SERVICES, "nats", "redis"}
    # NATS keeps nothing on disk (no JetStream): no StatefulSet, no volume claim.
    assert not by_kind(manifests, "StatefulSet")
    assert not by_kind(manifests, "PersistentVolumeClaim")
    # The detokenizer is a singleton, never rolled two at a time; nor is NATS (two
    # unclustered servers would split the services between them). The schedulers are
    # active/standby (tests/packaging/test_chart_scheduler.py).
    for singleton in ("detokenizer", "nats"):
        assert deployments[singleton]["spec"]["replicas"] == 1
        assert deployments[singleton]["spec"]["strategy"]["type"] == "Recreate"
    scheduler_args = deployments["scheduler"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert scheduler_args[scheduler_args.index("--routing") + 1] == "cache_aware"
    assert {component_of(p) for p in by_kind(manifests, "PodDisruptionBudget").values()} == {
        *SERVICES,
        "nats",
        "redis",
    }
    assert len(by_kind(manifests, "NetworkPolicy")) >= 5
    dashboards = by_kind(manifests, "ConfigMap")["rs-radixserve-dashboards"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = sorted(p.name for p in (CHART_DIR / "dashboards").glob("*.json"))
    assert shipped and sorted(dashboards["data"]) == shipped
    kinds = {m.body["kind"] for m in manifests}
    assert not kinds & {"ScaledObject", "ServiceMonitor", "HorizontalPodAutoscaler", "Ingress"}


def test_gpu_values_give_the_worker_gpus_and_the_cuda_image(
    rendered: dict[str, list[Manifest]],
) -> None:
    worker = by_kind(rendered["gpu"], "Deployment")["rs-radixserve-worker"]
    pod = worker["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith("radixserve-cuda:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    engine = by_kind(rendered["gpu"], "ConfigMap")["rs-radixserve-engine"]["data"]
    assert engine["RADIXSERVE_DEVICE"] == "cuda"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load
    # No surge pod waiting for the GPU the old pod holds.
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_all_features_render_what_they_promise(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["all-features"]
    hpas = by_kind(manifests, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {
        "rs-radixserve-gateway",
        "rs-radixserve-tokenizer",
    }
    (scaled,) = by_kind(manifests, "ScaledObject").values()
    trigger = scaled["spec"]["triggers"][0]
    assert (
        trigger["type"] == "prometheus"
        and "radixserve:num_queue_reqs" in trigger["metadata"]["query"]
    )
    deployments = by_kind(manifests, "Deployment")
    for autoscaled in ("gateway", "tokenizer", "worker"):  # the autoscaler owns the count
        assert "replicas" not in deployments[f"rs-radixserve-{autoscaled}"]["spec"]
    assert by_kind(manifests, "ServiceMonitor")
    tokenizer = deployments["rs-radixserve-tokenizer"]["spec"]["template"]["spec"]
    args = tokenizer["containers"][0]["args"]
    assert args[args.index("--context-length") + 1] == "4096"
    assert {v["name"] for v in tokenizer["volumes"]} >= {"tmp", "model"}
    assert by_kind(manifests, "Ingress")["rs-radixserve"]["spec"]["ingressClassName"] == "nginx"


def test_external_infra_is_used_and_not_deployed(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["external-infra"]
    config = by_kind(manifests, "ConfigMap")["rs-radixserve-config"]["data"]
    assert config["RADIXSERVE_NATS_URL"] == "nats://nats.infra:4223"
    assert config["RADIXSERVE_REDIS_URL"] == "redis://redis.infra:6380/0"
    assert not by_kind(manifests, "StatefulSet")
    egress = by_kind(manifests, "NetworkPolicy")["rs-radixserve-services-egress"]["spec"]["egress"]
    assert [rule["ports"][0]["port"] for rule in egress[:2]] == [4223, 6380]


def test_engine_config_map_is_what_the_worker_parses(rendered: dict[str, list[Manifest]]) -> None:
    """The chart's engine variables, read by the worker's own parser, are the engine's
    defaults: every EngineConfig option is there, no number turned into 1e+06."""
    env = by_kind(rendered["default"], "ConfigMap")["rs-radixserve-engine"]["data"]
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    # Options whose default is None (decided by the engine: context length, pool size,
    # batch limits by device) are left out while null in values.yaml.
    hidden = {"debug_check_invariants", "model_path"} | {
        name for name, field in fields.items() if field.default is None
    }
    missing = {f"RADIXSERVE_{n.upper()}" for n in fields if n not in hidden} - env.keys()
    assert missing == set(), "engine options missing from worker.engine in values.yaml"
    parsed = engine_kwargs(argparse.Namespace(), environ=env)
    for name, value in parsed.items():
        if name != "device":
            assert value == fields[name].default, f"{name}: {value!r} != {fields[name].default!r}"
    EngineConfig(**parsed)
    # The worker's own flag, parsed by its parser as the chart passes it.
    worker = next(
        d
        for d in by_kind(rendered["default"], "Deployment").values()
        if component_of(d) == "worker"
    )
    parser = argparse.ArgumentParser()
    worker_service.add_arguments(parser)
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["serve", "worker"]
    assert parser.parse_args(args[2:]).engine_stall_s == worker_service.DEFAULT_ENGINE_STALL_S


# docker-compose variable -> values.yaml key (docs/operations.md has the same table).
COMPOSE_TO_VALUES = {
    "RADIXSERVE_IMAGE": "image.repository",
    "RADIXSERVE_CUDA_IMAGE": "cudaImage.repository",
    "RADIXSERVE_IMAGE_TAG": "image.tag",
    "RADIXSERVE_SUBJECT_PREFIX": "config.subjectPrefix",
    "RADIXSERVE_MODEL": "config.model",
    "RADIXSERVE_MODEL_DIR": "modelDir",
    "RADIXSERVE_SERVED_MODEL_NAME": "config.servedModelName",
    "RADIXSERVE_CONTEXT_LENGTH": "config.contextLength",
    "RADIXSERVE_LOG_LEVEL": "config.logLevel",
    "RADIXSERVE_LOG_FORMAT": "config.logFormat",
    "RADIXSERVE_LOG_PROMPTS": "config.logPrompts",
    "RADIXSERVE_OTLP_ENDPOINT": "config.otlpEndpoint",
    "RADIXSERVE_EVENT_LOOP": "config.eventLoop",
    "RADIXSERVE_REQUEST_TIMEOUT_S": "gateway.requestTimeoutS",
    "RADIXSERVE_RECORD_TTL_S": "gateway.recordTtlS",
    "RADIXSERVE_RESUME_GRACE_S": "gateway.resumeGraceS",
    "RADIXSERVE_REASONING_PARSER": "gateway.reasoningParser",
    "RADIXSERVE_TOKENIZER_REPLICAS": "tokenizer.replicas",
    "RADIXSERVE_GRAMMAR_TIMEOUT_S": "tokenizer.grammarTimeoutS",
    "RADIXSERVE_MAX_PENDING_REQUESTS": "scheduler.maxPendingRequests",
    "RADIXSERVE_WORKER_TIMEOUT_S": "scheduler.workerTimeoutS",
    "RADIXSERVE_RETRY_AFTER_S": "scheduler.retryAfterS",
    "RADIXSERVE_ROUTING": "scheduler.routing",
    "RADIXSERVE_MAX_MIGRATIONS": "scheduler.maxMigrations",
    "RADIXSERVE_SCHEDULER_REPLICAS": "scheduler.replicas",
    "RADIXSERVE_HA_LEASE": "scheduler.haLease",
    "RADIXSERVE_HA_LEASE_TTL_S": "scheduler.haLeaseTtlS",
    "RADIXSERVE_GRAMMAR_REPLICAS": "grammar.replicas",
    "RADIXSERVE_COMPILE_TIMEOUT_S": "grammar.compileTimeoutS",
    "RADIXSERVE_COMPILE_LIMIT_S": "grammar.compileLimitS",
    "RADIXSERVE_ENGINE_STALL_S": "worker.engineStallS",
    "RADIXSERVE_COMPILE_WORKERS": "grammar.compileWorkers",
    "RADIXSERVE_GRAMMAR_CACHE_TTL_S": "grammar.cacheTtlS",
    "RADIXSERVE_DETOK_MAX_REQUESTS": "detokenizer.maxRequests",
    "RADIXSERVE_OUTPUT_LOG_TTL_S": "detokenizer.outputLogTtlS",
    "RADIXSERVE_GPU_WORKERS": "worker.replicas",
    "RADIXSERVE_CPU_WORKERS": "worker.replicas",
    "RADIXSERVE_GPU_COUNT": "worker.gpu.count",
    "RADIXSERVE_DEVICE": "worker.device",
    "RADIXSERVE_REDIS_MAXMEMORY": "redis.maxmemory",
}
# Compose-only: published ports, the bind address and the observability stack the chart
# leaves to the cluster's own Prometheus / Grafana.
COMPOSE_ONLY = {
    "RADIXSERVE_PUBLISH_HOST",
    "RADIXSERVE_HTTP_PORT",
    "RADIXSERVE_NATS_MONITOR_PORT",
    "RADIXSERVE_PROMETHEUS_PORT",
    "RADIXSERVE_PROMETHEUS_RETENTION",
    "RADIXSERVE_GRAFANA_PORT",
    "RADIXSERVE_JAEGER_PORT",
}
# Same setting, different default on purpose (compose brings its collector; the chart
# defaults to the CPU worker and to two tokenizers for availability; "" tag = the chart's
# appVersion; booleans spelled as such).
DIFFERENT_DEFAULTS = {
    "RADIXSERVE_TOKENIZER_REPLICAS",
    "RADIXSERVE_SCHEDULER_REPLICAS",  # compose: one; the chart: active/standby
    "RADIXSERVE_HA_LEASE",
    "RADIXSERVE_OTLP_ENDPOINT",
    "RADIXSERVE_DEVICE",
    "RADIXSERVE_IMAGE_TAG",
    "RADIXSERVE_LOG_PROMPTS",
    "RADIXSERVE_MODEL_DIR",
}


def _lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for key in dotted.split("."):
        assert isinstance(node, dict) and key in node, f"values.yaml has no {dotted}"
        node = node[key]
    return node


def _camel(name: str) -> str:
    first, *rest = name.lower().split("_")
    return first + "".join(part.capitalize() for part in rest)


def test_values_keys_follow_the_compose_variables() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    compose = variables(COMPOSE_FILE.read_text())
    engine = {f"RADIXSERVE_{key}" for key in _engine_fields()}
    unmapped = set(compose) - COMPOSE_TO_VALUES.keys() - COMPOSE_ONLY - engine
    assert unmapped == set(), "compose variables with no values.yaml key"
    for variable, default in compose.items():
        if variable in engine:
            path = "worker.engine." + _camel(variable.removeprefix("RADIXSERVE_"))
        elif variable in COMPOSE_TO_VALUES:
            path = COMPOSE_TO_VALUES[variable]
        else:
            continue
        value = _lookup(values, path)
        if variable not in DIFFERENT_DEFAULTS and path != "modelDir":
            shown = "" if value is None else str(value).lower()
            assert shown == str(default).lower(), f"{variable}={default} but {path}={value}"


def test_resumable_streams_settings_reach_their_services() -> None:
    """The output log's TTL and the resume grace, in the services' config, defaults and
    overrides; a negative one is refused by the schema."""
    config = by_kind(render_chart(CHART_DIR), "ConfigMap")["rs-radixserve-config"]["data"]
    assert config["RADIXSERVE_OUTPUT_LOG_TTL_S"] == "120"
    assert config["RADIXSERVE_RESUME_GRACE_S"] == "30"
    values = {"detokenizer": {"outputLogTtlS": 0}, "gateway": {"resumeGraceS": 7.5}}
    config = by_kind(render_chart(CHART_DIR, values), "ConfigMap")["rs-radixserve-config"]
    assert config["data"]["RADIXSERVE_OUTPUT_LOG_TTL_S"] == "0"
    assert config["data"]["RADIXSERVE_RESUME_GRACE_S"] == "7.5"
    for negative in ({"detokenizer": {"outputLogTtlS": -1}}, {"gateway": {"resumeGraceS": -1}}):
        with pytest.raises(HelmError, match="schema"):
            render_chart(CHART_DIR, negative)


def _engine_fields() -> list[str]:
    skip = {"model_path", "device", "context_length", "debug_check_invariants"}
    return [f.name.upper() for f in dataclasses.fields(EngineConfig) if f.name not in skip]


# --- secure by default: API keys, what the Ingress and the policies expose ------------

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


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _keys_volume(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(RADIXSERVE_API_KEYS_FILE, the secret volume mounted on its folder)."""
    container = pod["containers"][0]
    keys_file = _env(container)["RADIXSERVE_API_KEYS_FILE"]
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
        assert "RADIXSERVE_ALLOW_UNAUTHENTICATED" not in _env(pod["containers"][0])
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
    assert _env(container)["RADIXSERVE_ALLOW_UNAUTHENTICATED"] == "true"
    assert "RADIXSERVE_API_KEYS_FILE" not in _env(container)
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
    metrics_port = int(_env(gateway)["RADIXSERVE_METRICS_PORT"])
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


# --- the checks fail on broken inputs ------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"gateway": {"replicas": "two"}},  # a wrong type
        {"gatway": {"replicas": 2}},  # a typo
        # Without the lease, a second scheduler would split the in-flight table.
        {"scheduler": {"replicas": 2, "haLease": False}},
        {"worker": {"engine": {"schedulePolicy": "random"}}},  # not a policy
        {"scheduler": {"routing": "round_robin"}},  # not a routing policy
        {"config": {"model": ""}},  # no model
    ],
    ids=["type", "typo", "scheduler-replicas", "enum", "routing-enum", "empty-model"],
)
def test_broken_values_fail_lint_and_render(values: dict[str, Any]) -> None:
    assert lint_errors(CHART_DIR, values) != []
    with pytest.raises(HelmError, match="schema"):
        render_chart(CHART_DIR, values)


def test_broken_values_file_fails(tmp_path: Path) -> None:
    broken = tmp_path / "values.yaml"
    broken.write_text(GPU_VALUES.read_text().replace("count: 1", "count: one"))
    assert lint_errors(CHART_DIR, load_values(broken)) != []


def test_inconsistent_values_fail_with_a_clear_message() -> None:
    with pytest.raises(HelmError, match=r"needs worker\.device cuda"):
        render_chart(CHART_DIR, {"worker": {"gpu": {"enabled": True}}})
    with pytest.raises(HelmError, match=r"nats\.url is required"):
        render_chart(CHART_DIR, {"nats": {"enabled": False}})


def _chart_copy(tmp_path: Path) -> Path:
    target = tmp_path / "radixserve"
    shutil.copytree(CHART_DIR, target, symlinks=False)  # the dashboards link, resolved
    return target


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path.name}: update the test with the template"
    path.write_text(text.replace(old, new, 1))


def test_broken_template_syntax_fails_lint_and_render(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path)
    _edit(
        chart / "templates" / "gateway.yaml",
        "{{- $g := .Values.gateway }}",
        "{{- $g := .Values.gateway",
    )
    assert lint_errors(chart) != []
    with pytest.raises(HelmError, match=r"gateway\.yaml"):
        render_chart(chart)


def test_template_with_an_unknown_field_fails_strict_validation(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path)
    _edit(
        chart / "templates" / "_deployment.tpl", "revisionHistoryLimit: 5", "revisionHistoryLimt: 5"
    )
    errors = strict_errors(render_chart(chart), KUBE_VERSIONS[-1])
    assert any("revisionHistoryLimt" in e for e in errors), errors


def test_template_with_a_wrong_type_fails_strict_validation(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path)
    _edit(chart / "templates" / "nats.yaml", "replicas: 1", 'replicas: "one"')
    assert strict_errors(render_chart(chart), KUBE_VERSIONS[0]) != []


@pytest.mark.parametrize(
    ("template", "old", "new", "expected"),
    [
        (
            "_deployment.tpl",
            "resources:\n            {{- toYaml .resources | nindent 12 }}",
            "",
            "no cpu request",
        ),
        ("redis.yaml", "readinessProbe:", "readinessProbe_:", "no readinessProbe"),
        ("nats.yaml", "runAsNonRoot: true", "runAsNonRoot: false", "runAsNonRoot"),
    ],
    ids=["no-resources", "no-probe", "root"],
)
def test_container_policy_fails_on_a_weakened_template(
    tmp_path: Path, template: str, old: str, new: str, expected: str
) -> None:
    chart = _chart_copy(tmp_path)
    _edit(chart / "templates" / template, old, new)
    try:
        manifests = render_chart(chart)
    except HelmError as exc:
        pytest.fail(f"the edited chart no longer renders: {exc}")
    problems = container_violations(manifests)
    assert any(expected in p for p in problems), problems


def test_weakened_values_fail_the_container_policy() -> None:
    weakened = render_chart(CHART_DIR, {"securityContext": {"readOnlyRootFilesystem": False}})
    assert any("writable" in p for p in container_violations(weakened))


def test_network_policy_check_fails_when_metrics_rules_open_the_api(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path)
    _edit(
        chart / "templates" / "networkpolicy.yaml",
        "        - port: monitor\n",
        "        - port: http\n          protocol: TCP\n        - port: monitor\n",
    )
    manifests = render_chart(chart)
    gateway = [(labels, port) for c, labels, port in pod_ports(manifests) if c == "gateway"]
    labels, http = next((labels, port) for labels, port in gateway if port["name"] == "http")
    assert ingress_sources(manifests, labels, http) == [None, PROMETHEUS_PODS]


def test_ingress_check_fails_on_a_catch_all_path(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path)
    _edit(chart / "templates" / "ingress.yaml", '"path" "/v1"', '"path" "/"')
    routes = ingress_paths(render_chart(chart, {"ingress": {"enabled": True}}))
    assert routes != {"radixserve.local": CLIENT_PATHS}


# --- NATS and Redis with credentials -------------------------------------------------

NATS_SECRET = "rs-radixserve-nats-auth"
REDIS_SECRET = "rs-radixserve-redis-auth"
# The services that use Redis (records, grammars, resumable streams' output log).
REDIS_CLIENTS = ("gateway", "grammar", "detokenizer", "scheduler")
# files/nats-authorization.conf: `radixserve infra nats-auth-config` for this prefix,
# which the template replaces with config.subjectPrefix.
STAND_IN_PREFIX = "RADIXSERVE-SUBJECT-PREFIX"
AUTHORIZATION_FILE = CHART_DIR / "files" / "nats-authorization.conf"


def _secret_data(manifests: list[Manifest], name: str) -> dict[str, str]:
    data = by_kind(manifests, "Secret")[name]["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def _workload(manifests: list[Manifest], component: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, its first container) of the Deployment or StatefulSet of `component`."""
    for kind in ("Deployment", "StatefulSet"):
        for body in by_kind(manifests, kind).values():
            if component_of(body) == component:
                pod = body["spec"]["template"]["spec"]
                return pod, pod["containers"][0]
    raise AssertionError(f"no workload of {component}")


def _mounted_volume(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mounted on the folder of the file `path` (read-only)."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == posixpath.dirname(path)]
    assert mount["readOnly"] is True, path
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def readable_secret_keys(pod: dict[str, Any]) -> dict[str, set[str]]:
    """Secret name -> the keys the pod's containers can read (variables, envFrom, secret
    volumes, projected ones); `*` for all of them."""
    found: dict[str, set[str]] = {}
    for container in pod.get("initContainers", []) + pod["containers"]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                found.setdefault(ref["name"], set()).add(ref["key"])
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                found.setdefault(source["secretRef"]["name"], set()).add("*")
    for volume in pod.get("volumes", []):
        secrets = [volume["secret"]] if "secret" in volume else []
        secrets += [
            s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s
        ]
        for secret in secrets:
            name = secret.get("secretName") or secret["name"]
            keys = {item["key"] for item in secret.get("items", [])} or {"*"}
            found.setdefault(name, set()).update(keys)
    return found


def test_readable_secret_keys_sees_every_way_in() -> None:
    pod = {
        "containers": [
            {
                "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a"}}}],
                "envFrom": [{"secretRef": {"name": "all"}}],
            }
        ],
        "volumes": [
            {"name": "v", "secret": {"secretName": "s", "items": [{"key": "b", "path": "b"}]}},
            {"name": "p", "projected": {"sources": [{"secret": {"name": "whole"}}]}},
        ],
    }
    assert readable_secret_keys(pod) == {"s": {"a", "b"}, "all": {"*"}, "whole": {"*"}}


@pytest.mark.parametrize("prefix", ["radixserve", "prod-rs_2"])
def test_the_nats_authorization_is_radixserves_for_the_prefix(prefix: str) -> None:
    manifests = render_chart(CHART_DIR, {"config": {"subjectPrefix": prefix}})
    config = by_kind(manifests, "ConfigMap")["rs-radixserve-nats-config"]["data"]["nats.conf"]
    assert config == render_authorization(Subjects(prefix))


def test_the_charts_permissions_file_is_radixserves() -> None:
    assert AUTHORIZATION_FILE.read_text() == render_authorization(Subjects(STAND_IN_PREFIX)), (
        "the NATS permissions changed: radixserve infra --subject-prefix "
        f"{STAND_IN_PREFIX} nats-auth-config > charts/radixserve/files/nats-authorization.conf"
    )


def test_nats_gets_the_config_and_each_role_password(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["default"]
    pod, container = _workload(manifests, "nats")
    args = container["args"]
    assert "-m" in args  # monitoring, for the probes
    assert not {"-js", "--jetstream", "-sd", "--store_dir"} & set(args)  # nothing on disk
    assert [m["name"] for m in container["volumeMounts"]] == ["config"]
    config = args[args.index("-c") + 1]
    volume = _mounted_volume(pod, container, config)
    assert volume["configMap"]["name"] == "rs-radixserve-nats-config"
    assert posixpath.basename(config) == "nats.conf"
    variables = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert variables == {password_variable(r): {"name": NATS_SECRET, "key": r} for r in ROLES}
    passwords = _secret_data(manifests, NATS_SECRET)
    assert set(passwords) == set(ROLES) and len(set(passwords.values())) == len(ROLES)
    # The readiness probe is the monitoring port's: it needs no client credentials.
    assert container["readinessProbe"]["httpGet"]["port"] == "monitor"


@pytest.mark.parametrize("values", ["default", "external-infra"])
def test_each_service_gets_its_own_nats_user_and_no_other_password(
    rendered: dict[str, list[Manifest]], values: str
) -> None:
    manifests = rendered[values]
    nats_secret = NATS_SECRET if values == "default" else "nats-users"
    redis_secret = REDIS_SECRET if values == "default" else "redis-user"
    for component in SERVICES:
        pod, container = _workload(manifests, component)
        env = _env(container)
        assert env["RADIXSERVE_NATS_USER"] == component
        password = env["RADIXSERVE_NATS_PASSWORD_FILE"]
        secret = _mounted_volume(pod, container, password)["secret"]
        assert secret["secretName"] == nats_secret
        assert secret["items"] == [{"key": component, "path": posixpath.basename(password)}]
        readable = readable_secret_keys(pod)
        assert readable[nats_secret] == {component}, component
        if component in REDIS_CLIENTS:
            assert env["RADIXSERVE_REDIS_USER"] == DEFAULT_USER
            file = env["RADIXSERVE_REDIS_PASSWORD_FILE"]
            redis = _mounted_volume(pod, container, file)["secret"]
            assert redis["items"] == [{"key": "password", "path": posixpath.basename(file)}]
            assert readable[redis_secret] == {"password"}
        else:
            assert redis_secret not in readable, component
            assert "RADIXSERVE_REDIS_PASSWORD_FILE" not in env
        assert not [
            e
            for e in container.get("env", [])
            if "PASSWORD" in e["name"] and "value" in e and not e["name"].endswith("_FILE")
        ]


def _redis_rules(args: list[str]) -> list[str]:
    """The ACL rules of redis-server's `--user` arguments, as redis.conf lines."""
    rules: list[list[str]] = []
    current: list[str] | None = None
    for arg in args[1:]:
        if arg.startswith("--"):
            current = [] if arg == "--user" else None
            if current is not None:
                rules.append(current)
        elif current is not None:
            current.append(arg)
    return ["user " + " ".join(rule) for rule in rules]


def test_redis_turns_default_off_and_has_the_one_user(rendered: dict[str, list[Manifest]]) -> None:
    pod, container = _workload(rendered["default"], "redis")
    password = "$(REDISCLI_AUTH)"  # the kubelet puts the Secret's value there
    assert _redis_rules(container["args"]) == RedisAcl(DEFAULT_USER, password).config_lines()
    (variable,) = container["env"]
    assert variable["name"] == "REDISCLI_AUTH"
    assert variable["valueFrom"]["secretKeyRef"] == {"name": REDIS_SECRET, "key": "password"}
    assert readable_secret_keys(pod) == {REDIS_SECRET: {"password"}}


async def test_the_rendered_nats_lets_each_role_in_and_nobody_else(tmp_path: Path) -> None:
    """The chart's NATS arguments, config and Secret on a real nats-server, its variables
    set as the Deployment sets them; its probes' path answers on the monitoring port."""
    manifests = render_chart(CHART_DIR)
    _, container = _workload(manifests, "nats")
    config = tmp_path / "nats.conf"
    config.write_text(
        by_kind(manifests, "ConfigMap")["rs-radixserve-nats-config"]["data"]["nats.conf"]
    )
    passwords = _secret_data(manifests, NATS_SECRET)
    env = {e["name"]: passwords[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"]}
    args = list(container["args"])
    args[args.index("-c") + 1] = str(config)
    monitor = free_port()  # not the pod's 8222: tests run side by side
    args[args.index("-m") + 1] = str(monitor)
    with nats_server(args, tmp_path, env=env) as url:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor}{path}", timeout=5) as r:
                assert r.status == 200, probe
        for role in ("gateway", ADMIN):
            auth = NatsAuth(user=role, password=passwords[role])
            bus = await Bus.connect(BusSettings(url=url, name=f"test-{role}", auth=auth))
            try:
                assert (await bus.health()).ok
            finally:
                await bus.close()
        with pytest.raises(BusAuthError):
            await Bus.connect(BusSettings(url=url, connect_attempts=3))
        wrong = NatsAuth(user="gateway", password=passwords["scheduler"])
        with pytest.raises(BusAuthError):
            await Bus.connect(BusSettings(url=url, auth=wrong, connect_attempts=3))


def _probe(container: dict[str, Any], port: int, password: str) -> int:
    """The Redis readiness probe's command, run against `port` with REDISCLI_AUTH."""
    command = container["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"]
    line = command[2].replace("redis-cli", f"{redis_cli()} -p {port}", 1)
    done = subprocess.run(
        ["sh", "-c", line], env={"REDISCLI_AUTH": password}, capture_output=True, timeout=30
    )
    return done.returncode


async def test_the_rendered_redis_wants_its_user_and_the_probe_authenticates(
    tmp_path: Path,
) -> None:
    manifests = render_chart(CHART_DIR)
    _, container = _workload(manifests, "redis")
    password = _secret_data(manifests, REDIS_SECRET)["password"]
    args = [a.replace("$(REDISCLI_AUTH)", password) for a in container["args"][1:]]
    with redis_server(args, tmp_path) as port:
        url = f"redis://127.0.0.1:{port}/0"
        with pytest.raises(StoreAuthError):
            await Store.connect(StoreSettings(url=url, connect_attempts=2))
        right = RedisAuth(user=DEFAULT_USER, password=password)
        async with await Store.connect(StoreSettings(url=url, auth=right)) as store:
            await store.put_request("r1", {"status": "queued"}, ttl_s=60)
            assert await store.get_request("r1") == {"status": "queued"}
        assert _probe(container, port, password) == 0
        assert _probe(container, port, "not-" + password) != 0


def test_generated_secrets_are_kept_by_lookup(tmp_path: Path) -> None:
    """An upgrade keeps what is installed (`lookup`, here answered from a file): the API
    key, every role's password (a role new to the chart gets one) and Redis's."""
    chart = _chart_copy(tmp_path)
    _edit(
        chart / "templates" / "_helpers.tpl",
        '(lookup "v1" "Secret" .root.Release.Namespace .name).data',
        '(get (.root.Files.Get "installed.json" | fromJson) .name)',
    )

    def encoded(values: dict[str, str]) -> dict[str, str]:
        return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}

    kept_roles = {role: f"kept{role}" for role in ROLES if role != "worker"}
    installed = {
        "rs-radixserve-api-keys": encoded({"admin-api-key": "rsk-kept", "api-keys.json": "{}"}),
        NATS_SECRET: encoded(kept_roles),
        REDIS_SECRET: encoded({"password": "keptredis"}),
    }
    (chart / "installed.json").write_text(json.dumps(installed))
    manifests = render_chart(chart)
    assert (
        by_kind(manifests, "Secret")["rs-radixserve-api-keys"]["data"]
        == installed["rs-radixserve-api-keys"]
    )
    nats = _secret_data(manifests, NATS_SECRET)
    assert {r: p for r, p in nats.items() if r != "worker"} == kept_roles
    assert nats["worker"] not in kept_roles.values() and len(nats["worker"]) >= 32
    assert _secret_data(manifests, REDIS_SECRET) == {"password": "keptredis"}
    # Without an installed Secret (a first install): new random ones.
    fresh = render_chart(CHART_DIR)
    assert _secret_data(fresh, NATS_SECRET)["gateway"] != "keptgateway"


def test_external_servers_need_a_secret_or_an_explicit_no() -> None:
    external = {k: v for k, v in EXTERNAL_INFRA.items() if k in ("nats", "redis")}
    with pytest.raises(HelmError, match=r"natsAuth\.existingSecret is required"):
        render_chart(CHART_DIR, external)
    with pytest.raises(HelmError, match=r"redisAuth\.existingSecret is required"):
        render_chart(CHART_DIR, {**external, "natsAuth": {"enabled": False}})
    bare = render_chart(
        CHART_DIR, {**external, "natsAuth": {"enabled": False}, "redisAuth": {"enabled": False}}
    )
    for component in SERVICES:
        pod, container = _workload(bare, component)
        assert not [
            n for n in _env(container) if n.startswith(("RADIXSERVE_NATS_", "RADIXSERVE_REDIS_"))
        ]
        assert readable_secret_keys(pod).keys() <= {"rs-radixserve-api-keys"}
    assert "NATS credentials are OFF" in render_notes(
        CHART_DIR, {**external, "natsAuth": {"enabled": False}, "redisAuth": {"enabled": False}}
    )
    assert set(by_kind(bare, "Secret")) == {"rs-radixserve-api-keys"}
    assert not by_kind(render_chart(CHART_DIR, EXTERNAL_INFRA), "Secret").keys() - {
        "rs-radixserve-api-keys"
    }


def test_an_external_nats_may_give_creds_files() -> None:
    values = {**EXTERNAL_INFRA, "natsAuth": {"existingSecret": "nats-creds", "creds": True}}
    manifests = render_chart(CHART_DIR, values)
    for component in SERVICES:
        pod, container = _workload(manifests, component)
        env = _env(container)
        assert "RADIXSERVE_NATS_USER" not in env
        creds = env["RADIXSERVE_NATS_CREDS_FILE"]
        secret = _mounted_volume(pod, container, creds)["secret"]
        assert secret["items"] == [{"key": f"{component}.creds", "path": posixpath.basename(creds)}]
        assert readable_secret_keys(pod)["nats-creds"] == {f"{component}.creds"}
    with pytest.raises(HelmError, match=r"natsAuth\.creds"):
        render_chart(CHART_DIR, {"natsAuth": {"creds": True}})


TLS_VALUES: dict[str, Any] = {
    "nats": {"tls": {"enabled": True, "secretName": "bus-tls"}},
    "redis": {"tls": {"enabled": True, "secretName": "bus-tls", "verifyClients": True}},
}


def test_tls_mounts_the_secret_and_sets_the_variables() -> None:
    manifests = render_chart(CHART_DIR, TLS_VALUES)
    assert strict_errors(manifests, KUBE_VERSIONS[-1]) == []
    config = by_kind(manifests, "ConfigMap")["rs-radixserve-config"]["data"]
    assert config["RADIXSERVE_NATS_URL"].startswith("tls://")
    assert config["RADIXSERVE_REDIS_URL"].startswith("rediss://")
    pod, nats = _workload(manifests, "nats")
    args = nats["args"]
    for flag in ("--tlscert", "--tlskey", "--tlscacert"):
        assert (
            _mounted_volume(pod, nats, args[args.index(flag) + 1])["secret"]["secretName"]
            == "bus-tls"
        )
    assert "--tls" in args and "--tlsverify" not in args
    pod, redis = _workload(manifests, "redis")
    args = redis["args"]
    assert args[args.index("--tls-port") + 1] == "6379" and args[args.index("--port") + 1] == "0"
    assert args[args.index("--tls-auth-clients") + 1] == "yes"
    assert "--tls" in redis["readinessProbe"]["exec"]["command"][2]
    for component in SERVICES:
        pod, container = _workload(manifests, component)
        env = _env(container)
        files = ["RADIXSERVE_NATS_TLS_CA"]
        assert "RADIXSERVE_NATS_TLS_CERT" not in env  # the NATS server verifies no client
        if component in REDIS_CLIENTS:
            files += [
                "RADIXSERVE_REDIS_TLS_CA",
                "RADIXSERVE_REDIS_TLS_CERT",
                "RADIXSERVE_REDIS_TLS_KEY",
            ]
        for name in files:
            volume = _mounted_volume(pod, container, env[name])
            assert volume["secret"]["secretName"] == "bus-tls", (component, name)
    # The same ports: the NetworkPolicies are unchanged.
    egress = by_kind(manifests, "NetworkPolicy")["rs-radixserve-services-egress"]["spec"]["egress"]
    assert [rule["ports"][0]["port"] for rule in egress[:2]] == [4222, 6379]
    with pytest.raises(HelmError, match=r"nats\.tls\.secretName is required"):
        render_chart(CHART_DIR, {"nats": {"tls": {"enabled": True}}})


def test_notes_say_how_to_read_the_nats_admin_password() -> None:
    notes = render_notes(CHART_DIR)
    assert (
        f"kubectl -n llm get secret {NATS_SECRET} -o jsonpath='{{.data.admin}}' | base64 -d"
        in notes
    )
    assert "radixserve health --nats-url nats://127.0.0.1:4222 --subject-prefix radixserve" in notes
