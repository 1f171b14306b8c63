"""Credentials and TLS settings of the NATS and Redis connections: where they are read
from, that secrets stay out of URLs and reprs, the clear errors, the per-role NATS
permissions and the `nats-auth-config` command that prints them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.bus import BusSettings, NatsAuth
from radixserve.credentials import redact_url, secret_from_env, split_userinfo, with_userinfo
from radixserve.infra import ROLES, NatsUsers, RedisAcl, render_authorization, role_permissions
from radixserve.infra.nats_auth import INBOX, password_variable
from radixserve.protocol.subjects import Subjects, subject_matches
from radixserve.services.runtime import ServiceSettings, add_common_arguments, settings_from_args
from radixserve.store import RedisAuth, StoreSettings


def test_a_password_comes_from_the_variable_or_its_file(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert secret_from_env({"X_PASSWORD": "a"}, "X_PASSWORD") == "a"
    assert secret_from_env({"X_PASSWORD_FILE": str(secret)}, "X_PASSWORD") == "s3cret"
    assert secret_from_env({}, "X_PASSWORD") is None
    with pytest.raises(ValueError, match="not both"):
        secret_from_env({"X_PASSWORD": "a", "X_PASSWORD_FILE": str(secret)}, "X_PASSWORD")
    with pytest.raises(ValueError, match=r"cannot read .*/missing"):
        secret_from_env({"X_PASSWORD_FILE": str(tmp_path / "missing")}, "X_PASSWORD")


def test_userinfo_is_split_quoted_and_redacted() -> None:
    assert split_userinfo("nats://u:p%40ss@h:4222") == ("nats://h:4222", "u", "p@ss")
    assert split_userinfo("redis://h:6379/0") == ("redis://h:6379/0", None, None)
    assert with_userinfo("nats://h:1", "u", "p@ss") == "nats://u:p%40ss@h:1"
    assert redact_url("nats://u:p@h:1") == "nats://u:***@h:1"
    assert redact_url("nats://h:1") == "nats://h:1"


def test_bus_settings_take_the_url_password_out_and_hide_it() -> None:
    settings = BusSettings(url="nats://gateway:hunter2@127.0.0.1:4222")
    assert settings.url == "nats://127.0.0.1:4222"
    assert settings.auth.user == "gateway" and settings.auth.password == "hunter2"
    assert "hunter2" not in repr(settings)
    assert settings.auth.connect_options() == {"user": "gateway", "password": "hunter2"}
    with pytest.raises(ValueError, match="both in the URL and in the settings"):
        BusSettings(url="nats://a:b@h:1", auth=NatsAuth(user="c", password="d"))


def test_nats_settings_from_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file")
    env = {
        "RADIXSERVE_NATS_URL": "tls://nats:4222",
        "RADIXSERVE_NATS_USER": "worker",
        "RADIXSERVE_NATS_PASSWORD_FILE": str(secret),
    }
    settings = BusSettings.from_env(env, name="w")
    assert settings.auth == NatsAuth(user="worker", password="from-file")
    with pytest.raises(ValueError, match="needs a password"):
        BusSettings.from_env({"RADIXSERVE_NATS_USER": "worker"})
    with pytest.raises(ValueError, match=r"no such file .*/nope\.creds"):
        BusSettings.from_env({"RADIXSERVE_NATS_CREDS_FILE": str(tmp_path / "nope.creds")})
    creds = tmp_path / "u.creds"
    creds.write_text("x")
    with pytest.raises(ValueError, match="one of"):
        NatsAuth(user="u", password="p", creds_file=str(creds))
    with pytest.raises(ValueError, match="go together"):
        NatsAuth(tls_cert=str(creds))


def test_a_certificate_that_does_not_load_is_a_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"NATS TLS CA .*ca\.pem does not load"):
        NatsAuth(tls_ca=str(junk)).ssl_context()


def test_store_settings_credentials_and_tls(tmp_path: Path) -> None:
    settings = StoreSettings(url="redis://radixserve:pw@h:6379/0")
    assert settings.url == "redis://h:6379/0" and "pw" not in repr(settings)
    options = settings.client_options()
    assert (options["username"], options["password"]) == ("radixserve", "pw")
    assert "connection_class" not in options
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {
        "RADIXSERVE_REDIS_USER": "u",
        "RADIXSERVE_REDIS_PASSWORD": "p",
        "RADIXSERVE_REDIS_TLS_CA": str(ca),
    }
    tls = StoreSettings.from_env(env).client_options()
    assert tls["ssl_ca_certs"] == str(ca) and tls["connection_class"].__name__ == "SSLConnection"
    with pytest.raises(ValueError, match="needs a password"):
        RedisAuth(user="u")


def test_service_flags_and_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    monkeypatch.setenv("RADIXSERVE_NATS_PASSWORD", "pw")
    monkeypatch.setenv("RADIXSERVE_NATS_USER", "overridden-by-the-flag")
    monkeypatch.setenv("RADIXSERVE_REDIS_PASSWORD", "redis-pw")
    ns = parser.parse_args(
        ["--nats-user", "scheduler", "--nats-tls-ca", str(ca), "--redis-user", "radixserve"]
    )
    settings = settings_from_args("scheduler", ns)
    assert settings.nats_auth == NatsAuth(user="scheduler", password="pw", tls_ca=str(ca))
    assert settings.redis_auth == RedisAuth(user="radixserve", password="redis-pw")
    assert settings.bus_settings().auth == settings.nats_auth
    assert "pw" not in repr(settings)
    with pytest.raises(SystemExit):  # no flag takes a password
        parser.parse_args(["--nats-password", "x"])
    # A URL's userinfo moves into the credentials, out of the URL that is logged.
    from_url = ServiceSettings("worker", nats_url="nats://worker:pw@h:4222")
    assert from_url.nats_url == "nats://h:4222" and from_url.nats_auth.user == "worker"


def test_each_role_may_use_what_its_service_uses() -> None:
    s = Subjects("prod.rs")
    perms = role_permissions(s)
    assert set(perms) == set(ROLES)

    def may(role: str, action: str, subject: str) -> bool:
        allowed = getattr(perms[role], action)
        return any(subject_matches(pattern, subject) for pattern in allowed)

    assert may("gateway", "publish", s.tokenize)
    assert may("gateway", "subscribe", s.gateway_deltas("gw-1"))
    assert may("scheduler", "publish", s.worker_run("w-0"))
    assert may("scheduler", "subscribe", s.scheduler_ack("sched-0", "t1"))
    assert may("worker", "subscribe", s.worker_run("w-0"))
    assert may("worker", "publish", s.kv_events("w-0"))
    assert may("detokenizer", "publish", s.gateway_deltas("gw-1"))
    assert may("tokenizer", "publish", s.alive("tokenizer", "tok-0"))
    # What a service must not do.
    assert not may("tokenizer", "publish", s.worker_run("w-0"))
    assert not may("gateway", "publish", s.worker_run("w-0"))
    assert not may("worker", "publish", s.alive("gateway", "gw-1"))
    assert not may("detokenizer", "subscribe", s.tokenize)
    assert not any(may(r, "publish", "$JS.API.STREAM.LIST") for r in ROLES if r != "admin")
    # Every role's subjects are under the prefix (or its reply inbox).
    for permissions in perms.values():
        for pattern in (*permissions.publish, *permissions.subscribe):
            assert pattern in (">", INBOX) or pattern.startswith("prod.rs.")
    assert perms["grammar"].allow_responses and not perms["gateway"].allow_responses


def test_the_rendered_config_has_a_user_per_role() -> None:
    users = NatsUsers.generate()
    literal = render_authorization(Subjects(), users)
    for role in ROLES:
        assert f'user: "{role}"' in literal
        assert f'password: "{users.password(role)}"' in literal
    assert "hunter" not in repr(users)
    packaged = render_authorization(Subjects())
    assert f"password: ${password_variable('worker')}" in packaged
    assert password_variable("worker") == "RADIXSERVE_NATS_PASSWORD_WORKER"


def test_nats_auth_config_command_prints_the_rendered_block() -> None:
    for argv in (["-m", "radixserve.cli", "infra"], ["-m", "radixserve.infra"]):
        proc = subprocess.run(
            [sys.executable, *argv, "--subject-prefix", "prod.rs", "nats-auth-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == render_authorization(Subjects("prod.rs"))


def test_redis_acl_lines() -> None:
    acl = RedisAcl.generate()
    assert acl.config_lines() == [
        "user default off",
        f"user radixserve on >{acl.password} ~* &* +@all",
    ]
    assert acl.password not in repr(acl)
    with pytest.raises(ValueError, match="without blanks"):
        RedisAcl("radixserve", "two words")
