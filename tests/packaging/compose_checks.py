"""Parse and check docker-compose.yml the way `docker compose config` would, without Docker.

    text = COMPOSE_FILE.read_text()
    model = load_compose(text)            # interpolated, anchors merged, compose-spec validated
    compose_problems(text, model)         # [] when the cross-references and the policy hold

`load_compose` resolves YAML anchors and merge keys, interpolates `${VAR:-default}` in
every string value (from `env`, else the default) and casts the numeric fields as compose
does, then validates the result with compose-spec (the Compose
Specification's Rust implementation). compose-spec checks each service's shape but not
what refers to what, so `compose_problems` checks the rest: depends_on targets exist and
are healthy-able (or, waited on to complete, do not restart), named volumes are declared, bind mounts exist, every variable is a
documented RADIXSERVE_* one with a default, and the radixserve services are hardened.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import compose_spec
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
INIT_SECRETS = ROOT / "docker" / "init_secrets.py"
RADIXSERVE_IMAGES = ("${RADIXSERVE_IMAGE", "${RADIXSERVE_CUDA_IMAGE")
# The services that use Redis (records, grammars, resumable streams' output log).
REDIS_CLIENTS = ("gateway", "grammar", "detokenizer", "scheduler")
# `$$` (a literal dollar), `${NAME}`, `${NAME:-default}` / `-` / `:?` / `?` / `:+` / `+`, `$NAME`.
_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def variables(text: str) -> dict[str, str | None]:
    """Every variable the file's values interpolate -> its `:-` or `-` default (None: it
    has none; `-` keeps a value set empty). Comments are not interpolated, so they are
    not read."""
    found: dict[str, str | None] = {}
    for value in _strings(yaml.safe_load(text)):
        for match in _VARIABLE.finditer(value):
            name = match["braced"] or match["bare"]
            if name is None:
                continue  # `$$`
            default = match["arg"] if match["op"] in (":-", "-") else None
            if found.get(name) is None:
                found[name] = default
    return found


def _strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [s for value in node.values() for s in _strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in _strings(value)]
    return [node] if isinstance(node, str) else []


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name = match["braced"] or match["bare"]
        value = env.get(name)
        op, arg = match["op"], match["arg"] or ""
        if op in (":-", "-"):
            return value if value or (op == "-" and value is not None) else arg
        if op in (":?", "?"):
            if not value and not (op == "?" and value is not None):
                raise ValueError(f"required variable {name} is missing: {arg}")
            return value or ""
        if op in (":+", "+"):
            return arg if value or (op == "+" and value is not None) else ""
        return value or ""

    return _VARIABLE.sub(replace, text)


# Fields compose casts after interpolation (compose-go's type-cast table, the part used here).
_CAST_TO_INT = (
    ("services", "*", "deploy", "replicas"),
    ("services", "*", "deploy", "resources", "reservations", "devices", "*", "count"),
    ("services", "*", "healthcheck", "retries"),
)


def _interpolate_tree(node: Any, env: Mapping[str, str], path: tuple[str, ...] = ()) -> Any:
    """Interpolate every string value (not keys), as compose does after parsing the YAML."""
    if isinstance(node, dict):
        return {
            key: _interpolate_tree(value, env, (*path, str(key))) for key, value in node.items()
        }
    if isinstance(node, list):
        return [_interpolate_tree(value, env, (*path, "*")) for value in node]
    if not isinstance(node, str):
        return node
    value = interpolate(node, env)
    if any(_matches(path, pattern) for pattern in _CAST_TO_INT) and value.isdigit():
        return int(value)
    return value


def _matches(path: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    return len(path) == len(pattern) and all(
        p in ("*", k) for k, p in zip(path, pattern, strict=True)
    )


def load_compose(text: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The effective compose model (raises ValueError when compose-spec rejects it)."""
    parsed = yaml.safe_load(text)  # anchors and merge keys resolved
    if not isinstance(parsed, dict):
        raise ValueError("a compose file is a mapping")
    data: dict[str, Any] = _interpolate_tree(parsed, env or {})
    model = compose_spec.PyCompose.from_json(json.dumps(data))
    model.validate()
    model.to_spec()  # the full pydantic model of the specification
    return data


def compose_problems(text: str, model: dict[str, Any], root: Path = ROOT) -> list[str]:
    problems = [
        f"${{{name}}} has no default (write ${{{name}:-default}})"
        for name, default in variables(text).items()
        if default is None
    ]
    problems += [
        f"${{{name}}} is not a RADIXSERVE_* variable"
        for name in variables(text)
        if not name.startswith("RADIXSERVE_")
    ]
    services: dict[str, Any] = model.get("services", {})
    declared_volumes = set((model.get("volumes") or {}).keys())
    raw_services = yaml.safe_load(text)["services"]
    for name, service in services.items():
        problems += [
            f"{name}: {p}" for p in _service_problems(service, services, declared_volumes, root)
        ]
        if str(raw_services[name].get("image", "")).startswith(RADIXSERVE_IMAGES):
            problems += [f"{name}: {p}" for p in _hardening_problems(service)]
    return problems


def _service_problems(
    service: dict[str, Any], services: dict[str, Any], volumes: set[str], root: Path
) -> list[str]:
    problems = []
    image = str(service.get("image", ""))
    if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
        problems.append(f"image {image!r} is not pinned to a tag")
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        depends = {target: {"condition": "service_started"} for target in depends}
    for target, rule in depends.items():
        if target not in services:
            problems.append(f"depends_on an unknown service {target!r}")
        elif rule.get("condition") == "service_healthy" and "healthcheck" not in services[target]:
            problems.append(f"waits for {target} to be healthy, but {target} has no healthcheck")
        elif (
            rule.get("condition") == "service_completed_successfully"
            and str(services[target].get("restart", "no")).split(":")[0] not in ONE_SHOT_RESTARTS
        ):
            # A task restarted after it succeeds never stays completed: its waiters hang.
            problems.append(
                f"waits for {target} to complete, but {target} restarts "
                f"({services[target].get('restart')}: want no or on-failure)"
            )
    timeout = str(service.get("healthcheck", {}).get("timeout", ""))
    if timeout and _seconds(timeout) < MIN_HEALTHCHECK_TIMEOUT_S:
        problems.append(
            f"healthcheck timeout {timeout} is under {MIN_HEALTHCHECK_TIMEOUT_S:.0f}s "
            "(a loaded host answers late)"
        )
    for mount in service.get("volumes", []):
        source = mount.get("source") if isinstance(mount, dict) else str(mount).split(":")[0]
        if not source:
            continue
        if source.startswith((".", "/")):
            if source.startswith(".") and not (root / source).exists():
                problems.append(f"bind mount {source} does not exist")
        elif source not in volumes:
            problems.append(f"volume {source!r} is not declared under volumes:")
    return problems


MIN_HEALTHCHECK_TIMEOUT_S = 10.0
ONE_SHOT_RESTARTS = ("no", "on-failure")


def _seconds(duration: str) -> float:
    """A compose duration ("15s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    if not parts:
        raise ValueError(f"not a compose duration: {duration!r}")
    return sum(float(value) * units[unit] for value, unit in parts)


def _hardening_problems(service: dict[str, Any]) -> list[str]:
    problems = []
    if "healthcheck" not in service:
        problems.append("no healthcheck")
    if service.get("read_only") is not True:
        problems.append("root filesystem is writable (read_only: true)")
    user = str(service.get("user", ""))
    if not user or user.split(":")[0] in ("0", "root"):
        problems.append(f"runs as {user or 'the default user'}, not a non-root uid")
    if "no-new-privileges:true" not in service.get("security_opt", []):
        problems.append("privilege escalation allowed (security_opt no-new-privileges:true)")
    if "ALL" not in service.get("cap_drop", []):
        problems.append("capabilities not dropped (cap_drop: [ALL])")
    return problems


def published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, container port) of every port a service publishes; no address is
    every interface, 0.0.0.0, as Docker binds it."""
    found = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            found.append((str(port.get("host_ip") or "0.0.0.0"), str(port["target"])))
            continue
        parts = str(port).rsplit("/", 1)[0].split(":")
        host = parts[0] if len(parts) == 3 else "0.0.0.0"
        found.append((host, parts[-1]))
    return found


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read-only) of a service's short-syntax volumes."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *mode = str(volume).split(":")
        found[target] = (source, "ro" in mode)
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def init_args(model: dict[str, Any]) -> dict[str, str]:
    """secrets-init's command line: flag -> value (its folders, by what they hold)."""
    command = model["services"]["secrets-init"]["command"]
    return dict(zip(command[::2], command[1::2], strict=True))


def load_init_secrets() -> ModuleType:
    """docker/init_secrets.py (compose's secrets-init) as a module: its file names."""
    spec = importlib.util.spec_from_file_location("init_secrets", INIT_SECRETS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
