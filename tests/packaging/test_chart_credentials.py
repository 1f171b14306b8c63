"""charts/radixserve's NATS and Redis credentials: the NATS permissions are radixserve's,
each service reads its own NATS password (and the Redis user's, if it uses Redis) and no
other secret, the rendered servers let in whom they should on real nats-server and
redis-server, generated secrets are kept on upgrade, external servers and TLS."""

from __future__ import annotations

import base64
import json
import posixpath
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helm_python import HelmError

from radixserve.bus import NatsAuth
from radixserve.infra.nats_auth import ADMIN, ROLES, password_variable, render_authorization
from radixserve.infra.redis_acl import DEFAULT_USER, RedisAcl
from radixserve.infra.servers import free_port
from radixserve.protocol.subjects import Subjects
from tests.packaging.chart_values import EXTERNAL_INFRA, SERVICES
from tests.packaging.kube import (
    CHART_DIR,
    KUBE_VERSIONS,
    Manifest,
    by_kind,
    chart_copy,
    component_of,
    edit_file,
    env_values,
    render_chart,
    render_notes,
    strict_errors,
)
from tests.packaging.real_servers import (
    check_nats_wants,
    check_redis_wants,
    nats_server,
    redis_cli,
    redis_server,
)

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
        env = env_values(container)
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
        admitted = {role: passwords[role] for role in ("gateway", ADMIN)}
        wrong = NatsAuth(user="gateway", password=passwords["scheduler"])
        await check_nats_wants(url, admitted, wrong)


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
        await check_redis_wants(f"redis://127.0.0.1:{port}/0", DEFAULT_USER, password)
        assert _probe(container, port, password) == 0
        assert _probe(container, port, "not-" + password) != 0


def test_generated_secrets_are_kept_by_lookup(tmp_path: Path) -> None:
    """An upgrade keeps what is installed (`lookup`, here answered from a file): the API
    key, every role's password (a role new to the chart gets one) and Redis's."""
    chart = chart_copy(tmp_path)
    edit_file(
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
            n
            for n in env_values(container)
            if n.startswith(("RADIXSERVE_NATS_", "RADIXSERVE_REDIS_"))
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
        env = env_values(container)
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
        env = env_values(container)
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
