"""The compose stack's one-shot `secrets-init`: make its secrets once, keep them after.

    python /opt/radixserve/init_secrets.py --keys-dir /secrets --grafana-dir /grafana-secrets \\
        --nats-config-dir /nats-config --nats-users-dir /nats-users --redis-dir /redis-auth

In --keys-dir: `api-keys.json`, the hashed keys the gateway reads (RADIXSERVE_API_KEYS_FILE),
with an `admin` key of every scope whose clear text is `admin-api-key` (both 0600, made by
`radixserve keys create`). In --grafana-dir: `admin-password`, Grafana's admin password
(0640: Grafana reads it through the group of the image's user).

NATS: `<--nats-users-dir>/<role>/password` for each role of radixserve.infra.nats_auth (each
folder its own volume, mounted only into that role's service), and `nats.conf` in
--nats-config-dir, the nats-server config of those users with their permissions for the
subjects under $RADIXSERVE_SUBJECT_PREFIX (render_authorization, literal passwords: only
the NATS server mounts it). Redis: `password` and `users.acl` (RedisAcl: `default` off, the
`radixserve` user) in --redis-dir. All 0600.

A secret already there is kept, so a restarted stack has the same keys and passwords; the
NATS config and the ACL file are written again from them each time (a new prefix applies).
The folders are named volumes: a new one takes the owner of the image folder it is mounted
on, which the image makes 10001's. Every folder is checked before anything is written.
Exit 0 when every secret exists, else 1 with why.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from radixserve.infra.nats_auth import ROLES, NatsUsers, render_authorization
from radixserve.infra.redis_acl import RedisAcl
from radixserve.protocol.subjects import DEFAULT_PREFIX, Subjects
from radixserve.services.runtime import ENV_PREFIX

KEYS_FILE = "api-keys.json"
ADMIN_KEY_FILE = "admin-api-key"
GRAFANA_PASSWORD_FILE = "admin-password"
PASSWORD_FILE = "password"  # a NATS role's, and the Redis user's
NATS_CONFIG_FILE = "nats.conf"
REDIS_ACL_FILE = "users.acl"
ADMIN_SCOPES = "inference,admin,metrics"
CLI_TIMEOUT_S = 120.0


class InitError(RuntimeError):
    """A secret cannot be made (the message says why)."""


def writable_dir(path: Path) -> Path:
    if not path.is_dir():
        raise InitError(f"{path} is not a folder: mount the secrets volume there")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InitError(
            f"{path} is not writable by uid {os.getuid()}: a volume made from an image "
            "older than this one is root's (rebuild: docker compose build; then "
            "docker volume rm the volume)"
        )
    return path


def write_atomic(target: Path, text: str, mode: int) -> None:
    """Written whole, then renamed: no reader ever sees half a secret."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def kept_secret(path: Path) -> str | None:
    """The secret in `path`; None when there is none yet (or an interrupted run left it
    empty): make it."""
    if not path.is_file():
        return None
    return path.read_text(encoding="utf-8").strip() or None


def radixserve_cli() -> str:
    """The `radixserve` of this interpreter's environment (the image's venv)."""
    beside = Path(sys.executable).parent / "radixserve"
    found = str(beside) if beside.is_file() else shutil.which("radixserve")
    if not found:
        raise InitError("no radixserve command beside this Python or on PATH")
    return found


def ensure_admin_key(keys_dir: Path) -> None:
    """An `admin` key in the keys file unless there is one (`--if-missing`)."""
    command = [
        radixserve_cli(),
        "keys",
        "create",
        "--file",
        str(keys_dir / KEYS_FILE),
        "--name",
        "admin",
        "--scopes",
        ADMIN_SCOPES,
        "--key-out",
        str(keys_dir / ADMIN_KEY_FILE),
        "--if-missing",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise InitError(f"radixserve keys create did not finish in {CLI_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise InitError(f"radixserve keys create exited {done.returncode}: {done.stderr.strip()}")
    if done.stdout.strip():  # made, or kept; never the clear key (it goes to --key-out)
        print(f"secrets-init: {done.stdout.strip()}")
    if not (keys_dir / ADMIN_KEY_FILE).is_file():
        # The keys file names an admin whose clear text was deleted: nobody can use it.
        print(
            f"warning: {keys_dir / KEYS_FILE} has an admin key but {ADMIN_KEY_FILE} is gone: "
            "`radixserve keys revoke admin --file ...` and start again for a new one",
            file=sys.stderr,
        )


def ensure_grafana_password(grafana_dir: Path) -> None:
    target = grafana_dir / GRAFANA_PASSWORD_FILE
    if kept_secret(target) is None:
        write_atomic(target, secrets.token_urlsafe(32), 0o640)


def ensure_nats(users_dir: Path, config_dir: Path, prefix: str) -> None:
    """Each role's password (kept, or made), then the server's config of them all."""
    fresh = NatsUsers.generate()
    passwords = {}
    for role in ROLES:
        target = users_dir / role / PASSWORD_FILE
        password = kept_secret(target)
        if password is None:
            password = fresh.password(role)
            write_atomic(target, password, 0o600)
        passwords[role] = password
    config = render_authorization(Subjects(prefix), NatsUsers(passwords))
    write_atomic(config_dir / NATS_CONFIG_FILE, config, 0o600)


def ensure_redis(redis_dir: Path) -> None:
    target = redis_dir / PASSWORD_FILE
    password = kept_secret(target)
    if password is None:
        acl = RedisAcl.generate()
        write_atomic(target, acl.password, 0o600)
    else:
        acl = RedisAcl(password=password)  # a password of the wrong shape is refused here
    write_atomic(redis_dir / REDIS_ACL_FILE, "\n".join(acl.config_lines()) + "\n", 0o600)


def subject_prefix() -> str:
    """$RADIXSERVE_SUBJECT_PREFIX, as the services read it (checked by Subjects)."""
    prefix = os.environ.get(ENV_PREFIX, "").strip() or DEFAULT_PREFIX
    try:
        Subjects(prefix)
    except ValueError as exc:
        raise InitError(f"${ENV_PREFIX}: {exc}") from None
    return prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys-dir", type=Path, required=True)
    parser.add_argument("--grafana-dir", type=Path, required=True)
    parser.add_argument("--nats-config-dir", type=Path, required=True)
    parser.add_argument("--nats-users-dir", type=Path, required=True, help="a folder per role")
    parser.add_argument("--redis-dir", type=Path, required=True)
    ns = parser.parse_args(argv)
    folders = [ns.keys_dir, ns.grafana_dir, ns.nats_config_dir, ns.redis_dir]
    folders += [ns.nats_users_dir / role for role in ROLES]
    try:
        prefix = subject_prefix()
        for folder in folders:  # all of them first: nothing is made half-way
            writable_dir(folder)
        ensure_admin_key(ns.keys_dir)
        ensure_grafana_password(ns.grafana_dir)
        ensure_nats(ns.nats_users_dir, ns.nats_config_dir, prefix)
        ensure_redis(ns.redis_dir)
    except (InitError, OSError, ValueError) as exc:
        print(f"secrets-init: {exc}", file=sys.stderr)
        return 1
    print(f"secrets-init: ready (NATS subjects under {prefix!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
