"""docker-compose.yml: parsed and validated as `docker compose config` would, without a
Docker engine; its cross-references, its hardening, its variables and its wiring to the
observability stack (Prometheus targets, Grafana provisioning, the collector)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from radixserve.engine.config import EngineConfig
from radixserve.engine.flags import engine_kwargs
from tests.packaging.compose_checks import (
    COMPOSE_FILE,
    ROOT,
    compose_problems,
    environment,
    interpolate,
    load_compose,
    variables,
)

TEXT = COMPOSE_FILE.read_text()
RADIXSERVE_SERVICES = ("gateway", "tokenizer", "scheduler", "grammar", "detokenizer")
WORKERS = ("worker", "worker-cpu")
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return load_compose(TEXT)


def test_compose_file_is_valid_and_consistent(model: dict[str, Any]) -> None:
    assert compose_problems(TEXT, model) == []


def test_stack_has_every_piece(model: dict[str, Any]) -> None:
    services = model["services"]
    for name in ("nats", "redis", *RADIXSERVE_SERVICES, *WORKERS, "prometheus", "grafana"):
        assert name in services, name
    assert {"otel-collector", "jaeger"} <= services.keys()
    nats = services["nats"]
    assert "-js" in nats["command"] and "-m" in nats["command"]  # JetStream, monitoring
    assert any(str(v).startswith("nats-data:") for v in nats["volumes"])
    # The GPU worker in the `gpu` profile, the `cpu` profile's runs without one.
    gpu = services["worker"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert environment(services["worker-cpu"])["RADIXSERVE_DEVICE"] == "cpu"


def active(model: dict[str, Any], profiles: set[str]) -> dict[str, Any]:
    """The services `docker compose --profile ...` runs: those in no profile or in one."""
    return {
        name: service
        for name, service in model["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def default_profiles() -> set[str]:
    """COMPOSE_PROFILES of the .env beside the compose file (compose reads it when no
    --profile is given; a --profile replaces it)."""
    for line in (ROOT / ".env").read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "COMPOSE_PROFILES":
            return {p.strip() for p in value.split(",") if p.strip()}
    return set()


def test_plain_up_runs_the_gpu_worker_and_the_cpu_profile_no_cuda_image(
    model: dict[str, Any],
) -> None:
    assert default_profiles() == {"gpu"}
    plain = active(model, default_profiles())
    assert "worker" in plain and "worker-cpu" not in plain
    cpu = active(model, {"cpu"})
    assert "worker-cpu" in cpu and "worker" not in cpu
    for name, service in cpu.items():  # nothing to pull or build of the CUDA image
        assert "cuda" not in service.get("image", ""), name
        assert "cuda" not in service.get("build", {}).get("dockerfile", "").lower(), name


@pytest.mark.skipif(not shutil.which("docker"), reason="no docker CLI")
def test_docker_compose_config_of_the_cpu_profile_names_no_cuda_image() -> None:
    # `docker compose config` needs no engine; v1 (no `compose` subcommand) skips.
    probe = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"no compose v2 plugin: {probe.stderr.strip()[:200]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RADIXSERVE_", "COMPOSE_"))}
    rendered = subprocess.run(
        ["docker", "compose", "--profile", "cpu", "config", "--images"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout.split()  # fmt: skip
    assert "radixserve:0.1.0" in rendered
    assert not [image for image in rendered if "cuda" in image], rendered
    plain = subprocess.run(
        ["docker", "compose", "config", "--services"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout.split()  # fmt: skip
    assert "worker" in plain and "worker-cpu" not in plain


def test_every_service_waits_for_what_it_needs(model: dict[str, Any]) -> None:
    services = model["services"]
    for name in (*RADIXSERVE_SERVICES, *WORKERS):
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy", name
    for name in ("gateway", "grammar"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_every_variable_has_a_documented_default() -> None:
    docs = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in variables(TEXT) if f"`{name}`" not in docs]
    assert missing == [], "compose variables missing from docs/operations.md"


def test_variables_reach_the_services() -> None:
    env = {
        "RADIXSERVE_MAX_PENDING_REQUESTS": "77",
        "RADIXSERVE_ROUTING": "least_load",
        "RADIXSERVE_CHUNKED_PREFILL_SIZE": "512",
        "RADIXSERVE_TOKENIZER_REPLICAS": "3",
        "RADIXSERVE_MODEL_DIR": "/srv/models",
    }
    services = load_compose(TEXT, env)["services"]
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--max-pending-requests") + 1] == "77"
    assert scheduler[scheduler.index("--routing") + 1] == "least_load"
    assert environment(services["worker"])["RADIXSERVE_CHUNKED_PREFILL_SIZE"] == "512"
    assert services["tokenizer"]["deploy"]["replicas"] == 3
    assert "/srv/models:/models:ro" in services["tokenizer"]["volumes"]


def test_tokenizer_gets_a_context_length_only_when_one_is_set() -> None:
    unset = load_compose(TEXT)["services"]["tokenizer"]["command"][0]
    assert "--context-length" in unset  # shell text, expanded in the container
    assert "${RADIXSERVE_CONTEXT_LENGTH:+" in unset


def test_gpu_worker_keeps_its_built_kernels_in_a_volume(model: dict[str, Any]) -> None:
    """The worker's kernel caches (Triton, FlashInfer JIT) outlive its container: a named
    volume where the CUDA image points them, owned by the image's user, beside the model."""
    mounts = model["services"]["worker"]["volumes"]
    assert "kernel-cache:/tmp/.cache" in mounts and "models:/models:ro" in mounts
    assert "kernel-cache" in model["volumes"]
    dockerfile = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    for variable in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TORCHINDUCTOR_CACHE_DIR"):
        assert f"{variable}=/tmp/.cache" in dockerfile, variable
    # A new named volume copies the image folder's owner: the non-root user can write it.
    assert "install -d -o 10001 -g 10001 /tmp/.cache" in dockerfile
    assert model["services"]["worker"]["user"] == "10001:10001"


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_engine_variables_are_the_engine_defaults(
    model: dict[str, Any], worker: str
) -> None:
    """Every EngineConfig option is a variable, and its compose default is the engine's,
    as the worker itself parses the environment (radixserve.engine.flags)."""
    env = environment(model["services"][worker])
    fields = {
        f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "debug_check_invariants"
    }
    expected_names = {
        "RADIXSERVE_MODEL" if name == "model_path" else f"RADIXSERVE_{name.upper()}"
        for name in fields
    }
    assert expected_names - env.keys() == set(), "engine options missing from the compose worker"
    parsed = engine_kwargs(argparse.Namespace(), environ=env)
    for name, value in parsed.items():
        if name in ("model_path", "device"):
            continue
        assert value == fields[name].default, (
            f"RADIXSERVE_{name.upper()}={value} != {fields[name].default}"
        )


def test_prometheus_scrapes_every_service(model: dict[str, Any]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets.update({name: sd["port"] for name in sd["names"]})
    services = model["services"]
    assert targets["gateway"] == 8000
    for name in (*RADIXSERVE_SERVICES[1:], *WORKERS):
        port = environment(services[name]).get("RADIXSERVE_METRICS_PORT")
        assert port is not None, f"{name} has no /metrics port"
        assert targets.get(name) == int(port), f"Prometheus does not scrape {name}:{port}"


def test_grafana_provisions_the_dashboards_and_their_datasource(model: dict[str, Any]) -> None:
    grafana = model["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/var/lib/grafana/dashboards"] == "./dashboards"
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/radixserve.yml").read_text()
    )["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    sources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/radixserve.yml").read_text()
    )
    uids = {source["uid"] for source in sources["datasources"]}
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "dashboards" / Path(home).name).is_file()
    dashboards = sorted((ROOT / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        used = _datasource_uids(json.loads(path.read_text()))
        assert used <= uids, f"{path.name} uses datasources {used - uids} that are not provisioned"


def _datasource_uids(dashboard: Any) -> set[str]:
    """The datasource uids a dashboard names directly or as its variables' defaults."""
    found: set[str] = set()
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "datasource":
            current = variable.get("current", {}).get("value")
            if current:
                found.add(current)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            source = node.get("datasource")
            if isinstance(source, dict) and source.get("uid"):
                uid = source["uid"]
                if not str(uid).startswith(("$", "-- ")):
                    found.add(uid)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard.get("panels", []))
    return found


def test_traces_go_through_the_collector_to_jaeger(model: dict[str, Any]) -> None:
    endpoint = environment(model["services"]["gateway"])["RADIXSERVE_OTLP_ENDPOINT"]
    assert endpoint == "http://otel-collector:4318"
    config = yaml.safe_load((DEPLOY / "otel-collector" / "config.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert config["exporters"][pipeline["exporters"][0]]["endpoint"] == "jaeger:4317"


BROKEN: dict[str, tuple[Callable[[str], str], str]] = {
    # compose-spec itself: an unknown key in a service.
    "unknown-key": (
        lambda t: t.replace("    healthcheck: *healthcheck\n", "    healthcheck_: 1\n", 1),
        "healthcheck_",
    ),
    # a type error: replicas must be a number.
    "bad-type": (
        lambda t: t.replace("${RADIXSERVE_TOKENIZER_REPLICAS:-1}", "many"),
        "invalid type",
    ),
    # cross-references compose-spec does not check.
    "unknown-dependency": (
        lambda t: t.replace(
            "      detokenizer:\n        condition", "      detokeniser:\n        condition"
        ),
        "unknown service",
    ),
    "undeclared-volume": (lambda t: t.replace("  nats-data: {}\n", ""), "nats-data"),
    "no-default": (
        lambda t: t.replace(
            "${RADIXSERVE_REQUEST_TIMEOUT_S:-600}", "${RADIXSERVE_REQUEST_TIMEOUT_S}"
        ),
        "no default",
    ),
    "writable-root": (
        lambda t: t.replace("  read_only: true\n", "  read_only: false\n", 1),
        "writable",
    ),
    "unhealthy-dependency": (
        lambda t: t.replace('      test: ["CMD", "redis-cli", "ping"]\n', "").replace(
            "    healthcheck:\n      interval: 5s\n      timeout: 15s\n      retries: 5\n      start_period: 5s\n",
            "",
        ),
        "no healthcheck",
    ),
    # 3 s timed out on a loaded host while the services still served.
    "hasty-healthcheck": (
        lambda t: t.replace("  timeout: 15s\n", "  timeout: 3s\n", 1),
        "healthcheck timeout 3s",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_compose_file_fails(case: str) -> None:
    edit, expected = BROKEN[case]
    broken = edit(TEXT)
    assert broken != TEXT, "the edit did not apply: update the test with docker-compose.yml"
    try:
        problems = compose_problems(broken, load_compose(broken))
    except ValueError as exc:  # compose-spec refused it
        problems = [str(exc)]
    assert any(expected in p for p in problems), problems


def test_interpolation_follows_compose() -> None:
    text = "a ${X:-d} b ${Y-e} c $${Z} d ${W:+set} f $X"
    assert interpolate(text, {"X": "x", "Y": "", "W": "1"}) == "a x b  c ${Z} d set f x"
    assert interpolate(text, {}) == "a d b e c ${Z} d  f "
    assert variables(f"# ${{C}}\nk: {text}\n") == {"X": "d", "Y": "e", "W": None}
