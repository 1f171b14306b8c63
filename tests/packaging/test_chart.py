"""charts/radixserve: helm lint, rendering with the default, GPU, all-features and
external-infra values, strict schema validation of every object, the container policy on
every container, the values that follow docker-compose's variables, and proof that broken
values and templates make these checks fail. What the chart exposes is in
test_chart_exposure.py, its NATS and Redis credentials in test_chart_credentials.py."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python import HelmError

from radixserve.engine.config import EngineConfig
from radixserve.engine.flags import engine_kwargs
from radixserve.services import worker as worker_service
from tests.packaging.chart_values import SERVICES, VALUE_SETS
from tests.packaging.compose_checks import COMPOSE_FILE, variables
from tests.packaging.kube import (
    CHART_DIR,
    GPU_VALUES,
    KUBE_VERSIONS,
    Manifest,
    by_kind,
    chart_copy,
    component_of,
    container_violations,
    edit_file,
    lint_errors,
    load_values,
    render_chart,
    strict_errors,
)


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


def test_broken_template_syntax_fails_lint_and_render(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    edit_file(
        chart / "templates" / "gateway.yaml",
        "{{- $g := .Values.gateway }}",
        "{{- $g := .Values.gateway",
    )
    assert lint_errors(chart) != []
    with pytest.raises(HelmError, match=r"gateway\.yaml"):
        render_chart(chart)


def test_template_with_an_unknown_field_fails_strict_validation(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    edit_file(
        chart / "templates" / "_deployment.tpl", "revisionHistoryLimit: 5", "revisionHistoryLimt: 5"
    )
    errors = strict_errors(render_chart(chart), KUBE_VERSIONS[-1])
    assert any("revisionHistoryLimt" in e for e in errors), errors


def test_template_with_a_wrong_type_fails_strict_validation(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    edit_file(chart / "templates" / "nats.yaml", "replicas: 1", 'replicas: "one"')
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
    chart = chart_copy(tmp_path)
    edit_file(chart / "templates" / template, old, new)
    try:
        manifests = render_chart(chart)
    except HelmError as exc:
        pytest.fail(f"the edited chart no longer renders: {exc}")
    problems = container_violations(manifests)
    assert any(expected in p for p in problems), problems


def test_weakened_values_fail_the_container_policy() -> None:
    weakened = render_chart(CHART_DIR, {"securityContext": {"readOnlyRootFilesystem": False}})
    assert any("writable" in p for p in container_violations(weakened))
