"""docker-compose.yml: parsed and validated as `docker compose config` would, without a
Docker engine; its cross-references, its hardening, its variables and its wiring to the
observability stack (Prometheus targets, Grafana provisioning, the collector)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
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
    REDIS_CLIENTS,
    ROOT,
    compose_problems,
    environment,
    init_args,
    interpolate,
    load_compose,
    mounts,
    published,
    variables,
)

TEXT = COMPOSE_FILE.read_text()
RADIXSERVE_SERVICES = ("gateway", "tokenizer", "scheduler", "grammar", "detokenizer")
WORKERS = ("worker", "worker-cpu")
DEPLOY = ROOT / "deploy"


def test_compose_file_is_valid_and_consistent(compose_model: dict[str, Any]) -> None:
    assert compose_problems(TEXT, compose_model) == []


def test_stack_has_every_piece(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for name in ("nats", "redis", *RADIXSERVE_SERVICES, *WORKERS, "prometheus", "grafana"):
        assert name in services, name
    assert {"otel-collector", "jaeger"} <= services.keys()
    nats = services["nats"]
    # Monitoring, and no JetStream: NATS keeps nothing on disk (resumes are Redis's).
    assert "-m" in nats["command"]
    assert not {"-js", "--jetstream", "-sd", "--store_dir"} & set(nats["command"])
    assert [v for v, _ in mounts(nats).values()] == ["nats-config"]
    assert "js-enabled" not in " ".join(nats["healthcheck"]["test"])
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
    compose_model: dict[str, Any],
) -> None:
    assert default_profiles() == {"gpu"}
    plain = active(compose_model, default_profiles())
    assert "worker" in plain and "worker-cpu" not in plain
    cpu = active(compose_model, {"cpu"})
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


def test_every_service_waits_for_what_it_needs(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for name in (*RADIXSERVE_SERVICES, *WORKERS):
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy", name
    for name in REDIS_CLIENTS:
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
        "RADIXSERVE_HA_LEASE": "true",
        "RADIXSERVE_SCHEDULER_REPLICAS": "2",
    }
    services = load_compose(TEXT, env)["services"]
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--max-pending-requests") + 1] == "77"
    assert scheduler[scheduler.index("--routing") + 1] == "least_load"
    assert environment(services["scheduler"])["RADIXSERVE_HA_LEASE"] == "true"
    assert services["scheduler"]["deploy"]["replicas"] == 2
    assert environment(services["worker"])["RADIXSERVE_CHUNKED_PREFILL_SIZE"] == "512"
    assert services["tokenizer"]["deploy"]["replicas"] == 3
    assert "/srv/models:/models:ro" in services["tokenizer"]["volumes"]


def test_resumable_streams_settings_reach_their_services() -> None:
    defaults = load_compose(TEXT)["services"]
    assert environment(defaults["detokenizer"])["RADIXSERVE_OUTPUT_LOG_TTL_S"] == "120"
    assert environment(defaults["gateway"])["RADIXSERVE_RESUME_GRACE_S"] == "30"
    env = {"RADIXSERVE_OUTPUT_LOG_TTL_S": "0", "RADIXSERVE_RESUME_GRACE_S": "5"}
    services = load_compose(TEXT, env)["services"]
    assert environment(services["detokenizer"])["RADIXSERVE_OUTPUT_LOG_TTL_S"] == "0"
    assert environment(services["gateway"])["RADIXSERVE_RESUME_GRACE_S"] == "5"


def test_tokenizer_gets_a_context_length_only_when_one_is_set() -> None:
    unset = load_compose(TEXT)["services"]["tokenizer"]["command"][0]
    assert "--context-length" in unset  # shell text, expanded in the container
    assert "${RADIXSERVE_CONTEXT_LENGTH:+" in unset


def test_gpu_worker_keeps_its_built_kernels_in_a_volume(compose_model: dict[str, Any]) -> None:
    """The worker's kernel caches (Triton, FlashInfer JIT) outlive its container: a named
    volume where the CUDA image points them, owned by the image's user, beside the model."""
    mounts = compose_model["services"]["worker"]["volumes"]
    assert "kernel-cache:/tmp/.cache" in mounts and "models:/models:ro" in mounts
    assert "kernel-cache" in compose_model["volumes"]
    dockerfile = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    for variable in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TORCHINDUCTOR_CACHE_DIR"):
        assert f"{variable}=/tmp/.cache" in dockerfile, variable
    # A new named volume copies the image folder's owner: the non-root user can write it.
    assert "install -d -o 10001 -g 10001 /tmp/.cache" in dockerfile
    assert compose_model["services"]["worker"]["user"] == "10001:10001"


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_engine_variables_are_the_engine_defaults(
    compose_model: dict[str, Any], worker: str
) -> None:
    """Every EngineConfig option is a variable, and its compose default is the engine's,
    as the worker itself parses the environment (radixserve.engine.flags)."""
    env = environment(compose_model["services"][worker])
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


def test_prometheus_scrapes_every_service(compose_model: dict[str, Any]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets.update({name: sd["port"] for name in sd["names"]})
    services = compose_model["services"]
    for name in (*RADIXSERVE_SERVICES, *WORKERS):
        port = environment(services[name]).get("RADIXSERVE_METRICS_PORT")
        assert port is not None, f"{name} has no /metrics port"
        assert targets.get(name) == int(port), f"Prometheus does not scrape {name}:{port}"
    # The gateway's API port answers /metrics only with a key: not the one scraped.
    gateway = environment(services["gateway"])
    assert gateway["RADIXSERVE_METRICS_PORT"] != gateway["RADIXSERVE_GATEWAY_PORT"]
    assert [port for _, port in published(services["gateway"])] == ["8000"]
    # ...and its health is still "ready to serve", not "its metrics port answers".
    assert gateway["RADIXSERVE_HEALTH_URL"] == "http://127.0.0.1:8000/health/ready"


def test_auth_is_on_by_default(compose_model: dict[str, Any]) -> None:
    """secrets-init (a one-shot on the radixserve image) makes the keys file in a volume
    before the gateway starts; the gateway reads that file, mounted read-only."""
    services = compose_model["services"]
    init = services["secrets-init"]
    raw = yaml.safe_load(TEXT)["services"]["secrets-init"]
    assert raw["image"].startswith("${RADIXSERVE_IMAGE:-radixserve}")
    assert init["entrypoint"] == ["python", "/opt/radixserve/init_secrets.py"]
    assert init["restart"] == "no"
    keys_dir = init_args(compose_model)["--keys-dir"]
    volume, read_only = mounts(init)[keys_dir]
    assert not read_only
    gateway = services["gateway"]
    assert gateway["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    keys_file = Path(environment(gateway)["RADIXSERVE_API_KEYS_FILE"])
    assert keys_file.name == "api-keys.json"
    assert mounts(gateway)[str(keys_file.parent)] == (volume, True)
    assert volume in compose_model["volumes"]
    assert "RADIXSERVE_ALLOW_UNAUTHENTICATED" not in environment(gateway)
    assert "RADIXSERVE_ALLOW_UNAUTHENTICATED" not in TEXT
    # The documented way to read the key names the file secrets-init writes.
    assert f"docker compose exec gateway cat {keys_file.parent}/admin-api-key" in TEXT


def test_the_image_makes_the_secrets_volumes_writable_by_its_user(
    compose_model: dict[str, Any],
) -> None:
    """A new named volume copies the owner of the image folder it is mounted on: the
    non-root secrets-init can write its volumes only if the image made them 10001's."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    init = compose_model["services"]["secrets-init"]
    assert init["user"] == "10001:10001"
    assert set(mounts(init)) <= _image_secret_folders(dockerfile)
    script = init["entrypoint"][-1]
    assert "docker/init_secrets.py" in dockerfile and script.startswith("/opt/radixserve/")


def _image_secret_folders(dockerfile: str) -> set[str]:
    """The folders the image makes 10001's, mode 0700 or 0750 (`install -d ...`)."""
    text = dockerfile.replace("\\\n", " ")
    found: set[str] = set()
    for match in re.finditer(r"install -d -o 10001 -g 10001 -m 07[05]0((?:\s+/[^\s&;]+)+)", text):
        found.update(match[1].split())
    return found


def test_grafana_has_a_generated_password_and_no_anonymous_access(
    compose_model: dict[str, Any],
) -> None:
    services = compose_model["services"]
    grafana = services["grafana"]
    env = environment(grafana)
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env  # only its __FILE form
    password = Path(env["GF_SECURITY_ADMIN_PASSWORD__FILE"])
    grafana_dir = init_args(compose_model)["--grafana-dir"]
    volume, _ = mounts(services["secrets-init"])[grafana_dir]
    assert mounts(grafana)[str(password.parent)] == (volume, True)
    assert password.name == "admin-password"  # docker/init_secrets.py GRAFANA_PASSWORD_FILE
    # The file is 0640 and secrets-init's group's: Grafana's user is in that group.
    assert grafana["group_add"] == [services["secrets-init"]["user"].split(":")[1]]
    assert grafana["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    read = f"docker compose run --rm --entrypoint cat secrets-init {grafana_dir}/{password.name}"
    assert read in TEXT  # as its owner: `exec` in Grafana may lack group_add's group


def test_no_default_grafana_password_anywhere() -> None:
    """Neither compose nor its configuration sets a Grafana password (admin/admin)."""
    files = [COMPOSE_FILE, *sorted(p for p in DEPLOY.rglob("*") if p.is_file())]
    for path in files:
        text = path.read_text()
        assert not re.search(r"GF_SECURITY_ADMIN_PASSWORD\s*[:=]", text), path
        assert not re.search(r"(?m)^\s*admin_password\s*[:=]", text), path


LOOPBACK_ONLY = ("nats", "redis", "prometheus", "otel-collector", "jaeger", "grafana")
NOT_PUBLISHED = ("redis", "otel-collector")


@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_only_the_api_follows_the_publish_host(host: str | None) -> None:
    """RADIXSERVE_PUBLISH_HOST=0.0.0.0 opens the API (with its keys) to the network, and
    nothing else: the unauthenticated tools stay on loopback, the bus is never published."""
    env = {"RADIXSERVE_PUBLISH_HOST": host} if host else {}
    services = load_compose(TEXT, env)["services"]
    assert {address for address, _ in published(services["gateway"])} == {host or "127.0.0.1"}
    for name in LOOPBACK_ONLY:
        assert {address for address, _ in published(services[name])} <= {"127.0.0.1"}, name
    for name in NOT_PUBLISHED:
        assert published(services[name]) == [], name
    assert "4222" not in [port for _, port in published(services["nats"])]
    for name, service in services.items():  # the other radixserve services: no ports
        if name != "gateway" and name not in LOOPBACK_ONLY:
            assert published(service) == [], name


def test_published_ports_are_read_as_docker_binds_them() -> None:
    service = {"ports": ["8000", "9000:90", "127.0.0.1:3000:3000/tcp", {"target": 5}]}
    assert published(service) == [
        ("0.0.0.0", "8000"),
        ("0.0.0.0", "90"),
        ("127.0.0.1", "3000"),
        ("0.0.0.0", "5"),
    ]


def test_grafana_provisions_the_dashboards_and_their_datasource(
    compose_model: dict[str, Any],
) -> None:
    grafana = compose_model["services"]["grafana"]
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


def test_traces_go_through_the_collector_to_jaeger(compose_model: dict[str, Any]) -> None:
    endpoint = environment(compose_model["services"]["gateway"])["RADIXSERVE_OTLP_ENDPOINT"]
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
    "undeclared-volume": (lambda t: t.replace("  prometheus-data: {}\n", ""), "prometheus-data"),
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
        lambda t: re.sub(
            r"    healthcheck:\n      # As the radixserve user.*?start_period: 5s\n",
            "",
            t,
            count=1,
            flags=re.S,
        ),
        "no healthcheck",
    ),
    # An init task restarted after it succeeds: the gateway would wait for ever.
    "restarting-init": (
        lambda t: t.replace('    restart: "no"\n', "", 1),
        "waits for secrets-init to complete, but secrets-init restarts",
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
