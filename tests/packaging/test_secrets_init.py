"""docker/init_secrets.py, compose's secrets-init, run as the container runs it (the real
`radixserve keys create`, real folders): the admin key, Grafana's password, each NATS
role's password and the Redis user's are made once, with their modes, and kept on the next
start; the NATS config and the Redis ACL file it writes run real servers that let the
right users in and nobody else, and compose's Redis health check authenticates."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from radixserve.bus import NatsAuth
from radixserve.infra.nats_auth import ROLES, NatsUsers, render_authorization
from radixserve.infra.redis_acl import DEFAULT_USER, RedisAcl
from radixserve.infra.servers import free_port
from radixserve.protocol.subjects import Subjects
from tests.packaging.compose_checks import COMPOSE_FILE, INIT_SECRETS, load_compose, mounts
from tests.packaging.real_servers import (
    check_nats_wants,
    check_redis_wants,
    nats_server,
    redis_cli,
    redis_server,
)

SCRIPT = INIT_SECRETS
PREFIX = "compose-test"


def _dirs(root: Path, make: bool = True) -> dict[str, Path]:
    """secrets-init's folders (its volumes) under `root`, made unless `make` is false."""
    dirs = {
        "--keys-dir": root / "secrets",
        "--grafana-dir": root / "grafana",
        "--nats-config-dir": root / "nats-config",
        "--nats-users-dir": root / "nats-users",
        "--redis-dir": root / "redis-auth",
    }
    if make:
        for flag, folder in dirs.items():
            folder.mkdir()
            if flag == "--nats-users-dir":
                for role in ROLES:
                    (folder / role).mkdir()
    return dirs


def _init(dirs: dict[str, Path], prefix: str = PREFIX) -> subprocess.CompletedProcess[str]:
    args = [str(a) for pair in dirs.items() for a in pair]
    env = {**os.environ, "RADIXSERVE_SUBJECT_PREFIX": prefix}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_makes_the_admin_key_and_the_grafana_password_once(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    keys_dir, grafana_dir = dirs["--keys-dir"], dirs["--grafana-dir"]
    first = _init(dirs)
    assert first.returncode == 0, first.stderr
    key = (keys_dir / "admin-api-key").read_text().strip()
    assert key and key not in first.stdout  # the clear key goes to its file only
    keys = json.loads((keys_dir / "api-keys.json").read_text())["keys"]
    assert [k["name"] for k in keys] == ["admin"]
    assert keys[0]["sha256"] == hashlib.sha256(key.encode()).hexdigest()
    assert sorted(keys[0]["scopes"]) == ["admin", "inference", "metrics"]
    password = (grafana_dir / "admin-password").read_text()
    assert len(password) >= 32 and password != "admin" and password.strip() == password
    assert _mode(keys_dir / "admin-api-key") == 0o600
    assert _mode(keys_dir / "api-keys.json") == 0o600
    assert _mode(grafana_dir / "admin-password") == 0o640
    files = sorted(p.name for p in (*keys_dir.iterdir(), *grafana_dir.iterdir()))
    assert files == ["admin-api-key", "admin-password", "api-keys.json"]  # no temporaries

    second = _init(dirs)  # a restarted stack: the same secrets
    assert second.returncode == 0, second.stderr
    assert (keys_dir / "admin-api-key").read_text().strip() == key
    assert json.loads((keys_dir / "api-keys.json").read_text())["keys"] == keys
    assert (grafana_dir / "admin-password").read_text() == password


def test_a_missing_volume_is_a_clear_error(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    (dirs["--nats-users-dir"] / "worker").rmdir()
    done = _init(dirs)
    assert done.returncode == 1
    assert f"{dirs['--nats-users-dir'] / 'worker'} is not a folder" in done.stderr
    made = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert made == []  # every folder is checked first: nothing made half-way


def _nats_passwords(dirs: dict[str, Path]) -> dict[str, str]:
    return {role: (dirs["--nats-users-dir"] / role / "password").read_text() for role in ROLES}


def _secret_files(dirs: dict[str, Path]) -> list[Path]:
    folders = [dirs["--nats-config-dir"], dirs["--redis-dir"]]
    folders += [dirs["--nats-users-dir"] / role for role in ROLES]
    return sorted(p for folder in folders for p in folder.iterdir())


def test_nats_and_redis_secrets_are_made_once_and_the_configs_follow(tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    first = _init(dirs)
    assert first.returncode == 0, first.stderr
    passwords = _nats_passwords(dirs)
    assert len(set(passwords.values())) == len(ROLES)  # one each, none shared
    assert all(len(p) >= 32 and p not in first.stdout for p in passwords.values())
    redis_password = (dirs["--redis-dir"] / "password").read_text()
    for path in _secret_files(dirs):
        assert _mode(path) == 0o600, path
    made = {str(p.relative_to(tmp_path)) for p in _secret_files(dirs)}
    expected = {"nats-config/nats.conf", "redis-auth/password", "redis-auth/users.acl"}
    assert made == expected | {f"nats-users/{role}/password" for role in ROLES}  # no temporaries
    config = (dirs["--nats-config-dir"] / "nats.conf").read_text()
    assert config == render_authorization(Subjects(PREFIX), NatsUsers(passwords))
    acl = (dirs["--redis-dir"] / "users.acl").read_text()
    assert acl.splitlines() == RedisAcl(DEFAULT_USER, redis_password).config_lines()

    # A restarted stack with another prefix: the same passwords, the config for the prefix.
    second = _init(dirs, prefix="other")
    assert second.returncode == 0, second.stderr
    assert _nats_passwords(dirs) == passwords
    assert (dirs["--redis-dir"] / "password").read_text() == redis_password
    again = (dirs["--nats-config-dir"] / "nats.conf").read_text()
    assert again == render_authorization(Subjects("other"), NatsUsers(passwords))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = _dirs(tmp_path_factory.mktemp("secrets-init"))
    done = _init(dirs)
    assert done.returncode == 0, done.stderr
    return dirs


async def test_the_nats_config_lets_each_role_in_and_nobody_else(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """nats-server started with compose's arguments (-c nats.conf -m PORT): the gateway's
    user with its password may do what the gateway does; no credentials, or another role's
    password, are refused; compose's health check URL answers on the monitoring port."""
    nats = load_compose(COMPOSE_FILE.read_text())["services"]["nats"]
    config = made["--nats-config-dir"] / "nats.conf"
    assert nats["command"][:2] == ["-c", f"/etc/nats/radixserve/{config.name}"]
    args = ["-c", str(config), *nats["command"][2:]]
    monitor = free_port()  # not the container's 8222: tests run side by side
    args[args.index("-m") + 1] = str(monitor)
    health = urllib.parse.urlsplit(nats["healthcheck"]["test"][-1])
    passwords = _nats_passwords(made)
    with nats_server(args, tmp_path) as url:
        probe = health._replace(netloc=f"127.0.0.1:{monitor}").geturl()
        with urllib.request.urlopen(probe, timeout=5) as answer:
            assert answer.status == 200
        wrong = NatsAuth(user="gateway", password=passwords["worker"])
        await check_nats_wants(url, {"gateway": passwords["gateway"]}, wrong)


def _redis_healthcheck(port: int, password_file: Path) -> int:
    """compose's Redis health check, its container paths pointed at this machine's."""
    redis = load_compose(COMPOSE_FILE.read_text())["services"]["redis"]
    test: list[Any] = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    (container_dir,) = [t for t, (src, _) in mounts(redis).items() if src == "redis-auth"]
    command = test[1].replace(f"{container_dir}/password", str(password_file))
    assert command != test[1], "the health check does not read the mounted password"
    command = command.replace("redis-cli", f"{redis_cli()} -p {port}", 1)
    return subprocess.run(["sh", "-c", command], capture_output=True, timeout=30).returncode


async def test_the_redis_acl_file_turns_default_off_and_the_healthcheck_authenticates(
    made: dict[str, Path], tmp_path: Path
) -> None:
    acl = made["--redis-dir"] / "users.acl"
    password = (made["--redis-dir"] / "password").read_text()
    with redis_server(
        ["--aclfile", str(acl), "--save", "", "--appendonly", "no"], tmp_path
    ) as port:
        await check_redis_wants(f"redis://127.0.0.1:{port}/0", DEFAULT_USER, password)
        assert _redis_healthcheck(port, made["--redis-dir"] / "password") == 0
        wrong = tmp_path / "wrong-password"
        wrong.write_text("not-" + password)
        assert _redis_healthcheck(port, wrong) != 0
