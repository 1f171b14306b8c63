"""docker-compose.yml's NATS and Redis credentials, secrets-init's: the servers run with
the config and the ACL it writes, each service is its own NATS user and mounts its own
password (and the Redis user's, if it uses Redis) and no other, no password is in clear
in any environment, and the operator reads the admin password as the file documents."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from radixserve.infra.nats_auth import ADMIN, ROLES
from radixserve.infra.redis_acl import DEFAULT_USER
from tests.packaging.compose_checks import (
    COMPOSE_FILE,
    REDIS_CLIENTS,
    environment,
    init_args,
    load_init_secrets,
    mounts,
)

TEXT = COMPOSE_FILE.read_text()
INIT = load_init_secrets()
# Each radixserve service -> its NATS role (radixserve.infra.nats_auth).
NATS_ROLE = {
    "gateway": "gateway",
    "tokenizer": "tokenizer",
    "scheduler": "scheduler",
    "grammar": "grammar",
    "detokenizer": "detokenizer",
    "worker": "worker",
    "worker-cpu": "worker",
}


def _init_volume(model: dict[str, Any], path: str) -> str:
    """The volume secrets-init writes at `path` (mounted writable)."""
    volume, read_only = mounts(model["services"]["secrets-init"])[path]
    assert not read_only, path
    return volume


def _role_volumes(model: dict[str, Any]) -> dict[str, str]:
    users_dir = init_args(model)["--nats-users-dir"]
    return {role: _init_volume(model, f"{users_dir}/{role}") for role in ROLES}


def _mounted_file(service: dict[str, Any], path: str) -> tuple[str, bool]:
    """(volume, read-only) of the mount that holds the file `path`."""
    return mounts(service)[str(Path(path).parent)]


def _after(service: dict[str, Any], target: str, condition: str) -> bool:
    return bool(service.get("depends_on", {}).get(target, {}).get("condition") == condition)


def test_nats_runs_with_the_config_secrets_init_writes(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    nats = services["nats"]
    command = nats["command"]
    config = command[command.index("-c") + 1]
    assert Path(config).name == INIT.NATS_CONFIG_FILE
    volume = _init_volume(compose_model, init_args(compose_model)["--nats-config-dir"])
    assert _mounted_file(nats, config) == (volume, True)
    assert _after(nats, "secrets-init", "service_completed_successfully")
    # The config holds every role's password: the NATS server alone mounts it.
    holders = [name for name, s in services.items() if volume in {v for v, _ in mounts(s).values()}]
    assert sorted(holders) == ["nats", "secrets-init"]
    # secrets-init renders the permissions for the services' own prefix.
    prefix = environment(services["secrets-init"])["RADIXSERVE_SUBJECT_PREFIX"]
    assert prefix == environment(services["gateway"])["RADIXSERVE_SUBJECT_PREFIX"]


def test_redis_runs_with_the_acl_secrets_init_writes(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    redis = services["redis"]
    command = redis["command"]
    acl = command[command.index("--aclfile") + 1]
    assert Path(acl).name == INIT.REDIS_ACL_FILE
    volume = _init_volume(compose_model, init_args(compose_model)["--redis-dir"])
    assert _mounted_file(redis, acl) == (volume, True)
    assert _after(redis, "secrets-init", "service_completed_successfully")
    # Its files are secrets-init's, 0600: Redis runs as their owner.
    assert redis["user"] == services["secrets-init"]["user"]
    # The health check authenticates as the ACL's user, with the mounted password
    # (test_secrets_init runs it against a real redis-server).
    test = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and f"--user {DEFAULT_USER} " in test[1]
    assert f"{Path(acl).parent}/{INIT.PASSWORD_FILE}" in test[1]


def test_each_service_is_its_own_nats_user_and_sees_no_other_password(
    compose_model: dict[str, Any],
) -> None:
    services = compose_model["services"]
    roles = _role_volumes(compose_model)
    nats_config = _init_volume(compose_model, init_args(compose_model)["--nats-config-dir"])
    redis_volume = _init_volume(compose_model, init_args(compose_model)["--redis-dir"])
    for name, role in NATS_ROLE.items():
        service = services[name]
        env = environment(service)
        assert env["RADIXSERVE_NATS_USER"] == role, name
        password = env["RADIXSERVE_NATS_PASSWORD_FILE"]
        assert Path(password).name == INIT.PASSWORD_FILE
        assert _mounted_file(service, password) == (roles[role], True), name
        assert _after(service, "secrets-init", "service_completed_successfully"), name
        seen = {volume for volume, _ in mounts(service).values()}
        assert seen & (set(roles.values()) | {nats_config}) == {roles[role]}, name
        if name in REDIS_CLIENTS:
            assert env["RADIXSERVE_REDIS_USER"] == DEFAULT_USER
            password = env["RADIXSERVE_REDIS_PASSWORD_FILE"]
            assert _mounted_file(service, password) == (redis_volume, True), name
        else:  # no service gets a secret it does not use
            assert redis_volume not in seen, name
            assert not {k for k in env if k.startswith("RADIXSERVE_REDIS_")} - {
                "RADIXSERVE_REDIS_URL"
            }, name
    # admin's password is the operator's: in secrets-init only.
    holders = [n for n, s in services.items() if roles[ADMIN] in {v for v, _ in mounts(s).values()}]
    assert holders == ["secrets-init"]


# Names of variables that would hold a secret in clear (their _FILE forms are fine).
_SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|CREDENTIAL|TOKEN$|API_KEY$|_AUTH$|PASS$")


def clear_secrets(env: dict[str, str]) -> list[str]:
    return [k for k in env if _SECRET_NAME.search(k) and not k.endswith("_FILE")]


def test_no_password_in_clear_in_any_environment(compose_model: dict[str, Any]) -> None:
    for name, service in compose_model["services"].items():
        assert clear_secrets(environment(service)) == [], name
    assert clear_secrets({"RADIXSERVE_NATS_PASSWORD": "x", "REDISCLI_AUTH": "y"}) == [
        "RADIXSERVE_NATS_PASSWORD",
        "REDISCLI_AUTH",
    ]
    assert "--requirepass" not in TEXT


def test_the_operator_reads_the_nats_admin_password_and_runs_health(
    compose_model: dict[str, Any],
) -> None:
    """`radixserve health` as admin, from the secrets-init container (on the compose
    network, with admin's password file): the commands the file documents work there."""
    services = compose_model["services"]
    init = services["secrets-init"]
    env = environment(init)
    admin_file = f"{init_args(compose_model)['--nats-users-dir']}/{ADMIN}/{INIT.PASSWORD_FILE}"
    assert env["RADIXSERVE_NATS_USER"] == ADMIN
    assert env["RADIXSERVE_NATS_PASSWORD_FILE"] == admin_file
    assert env["RADIXSERVE_NATS_URL"] == environment(services["gateway"])["RADIXSERVE_NATS_URL"]
    assert f"docker compose run --rm --entrypoint cat secrets-init {admin_file}" in TEXT
    assert "docker compose run --rm --entrypoint radixserve secrets-init health" in TEXT
    assert "depends_on" not in init  # `run` starts nothing else
