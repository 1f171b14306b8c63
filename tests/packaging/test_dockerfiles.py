"""The Dockerfiles, checked without a Docker engine: hadolint, the image policy, the pinned
dependency lock, the build context, and the health check script the images run."""

from __future__ import annotations

import http.server
import importlib
import importlib.metadata as metadata
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.packaging.docker_checks import (
    DOCKER_DIR,
    DOCKERFILES,
    ROOT,
    copy_sources,
    dockerfile_problems,
    dockerignore_admits,
    dockerignore_patterns,
    hadolint_findings,
    pip_unpinned,
    radixserve_imports,
)

HEALTHCHECK = DOCKER_DIR / "healthcheck.py"
LOCK = DOCKER_DIR / "requirements.txt"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    assert hadolint_findings(dockerfile) == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_policy_holds(dockerfile: Path) -> None:
    assert dockerfile_problems(dockerfile.read_text()) == []


def test_hadolint_fails_on_a_broken_dockerfile(tmp_path: Path) -> None:
    # An unpinned, recommends-pulling apt install as root at the end: hadolint must object.
    broken = tmp_path / "Dockerfile"
    text = DOCKERFILES[0].read_text()
    broken.write_text(text + "USER root\nRUN apt-get install -y curl\n")
    codes = " ".join(hadolint_findings(broken))
    assert "DL3002" in codes  # last USER is root
    assert "DL3008" in codes  # apt version not pinned


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("USER 10001:10001", "USER 0"), "numeric non-root uid"),
        (lambda t: t.replace("HEALTHCHECK", "# HEALTHCHECK"), "no HEALTHCHECK"),
        (lambda t: t.replace("HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE=0"), "HF_HUB_OFFLINE"),
        (lambda t: t.replace("python:3.11.11-slim-bookworm", "python:latest"), "not pinned"),
        (
            lambda t: t.replace("RUN pip install --no-deps -r", "RUN pip install requests -r"),
            "requests",
        ),
        (
            lambda t: t.replace("&& chmod -R a+rX /opt/radixserve/models", ""),
            "/opt/radixserve/models is copied without being made readable",
        ),
    ],
    ids=["root-user", "no-healthcheck", "hub-online", "latest-base", "unpinned-pip", "0700-model"],
)
def test_image_policy_fails_on_a_broken_dockerfile(
    edit: Callable[[str], str], expected: str
) -> None:
    text = DOCKERFILES[0].read_text()
    broken = edit(text)
    assert broken != text, "the edit did not apply: update the test with the Dockerfile"
    problems = dockerfile_problems(broken)
    assert any(expected in p for p in problems), problems


def test_pip_pins_are_read_per_command() -> None:
    assert pip_unpinned('pip install "torch==2.1" numpy && pip install -r req.txt .') == ["numpy"]
    assert pip_unpinned("pip install --no-deps --target /t 'x==1' && echo pip") == []


def locked() -> dict[str, str]:
    """name -> the version docker/requirements.txt pins (markers dropped)."""
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.split(";")[0].strip().partition("==")
            assert sep, f"{line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def test_lock_pins_every_runtime_dependency_within_its_range() -> None:
    """docker/requirements.txt (docker/lock.py) must still satisfy pyproject.toml."""
    pins = locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":  # each Dockerfile installs its own build (CPU or CUDA)
            continue
        assert name in pins, f"{name} is missing from {LOCK.name}: run docker/lock.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not satisfy {requirement}: run docker/lock.py"
        )


def test_lock_is_whole_on_the_oldest_python_the_project_admits() -> None:
    """The images install the lock with --no-deps on any 3.11 (`PYTHON_IMAGE`): what a
    locked package needs there must be locked too (redis: async-timeout before 3.11.3)."""
    sys.path.insert(0, str(DOCKER_DIR))
    try:
        import lock
    finally:
        sys.path.remove(str(DOCKER_DIR))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = lock.oldest_environment(project["requires-python"])
    assert oldest["python_full_version"] == "3.11.0"
    pins = locked()
    missing = []
    for name in pins:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # needed only on an older Python than this
            continue
        for text in requires:
            requirement = Requirement(text)
            wanted = canonicalize_name(requirement.name)
            if lock.holds(requirement, oldest, "") and wanted not in pins:
                if not lock.IMAGE_SPECIFIC.match(wanted):
                    missing.append(f"{name} needs {requirement}")
    assert missing == [], "run docker/lock.py"


def test_build_context_admits_everything_the_dockerfiles_copy() -> None:
    patterns = dockerignore_patterns((ROOT / ".dockerignore").read_text())
    for dockerfile in DOCKERFILES:
        for source in copy_sources(dockerfile.read_text()):
            assert dockerignore_admits(patterns, source), f"{dockerfile.name} copies {source}"
            assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which is missing"
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py"):
        assert not dockerignore_admits(patterns, heavy), f"{heavy} is in the build context"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_python_a_dockerfile_runs_imports_what_exists(dockerfile: Path) -> None:
    imports = radixserve_imports(dockerfile.read_text())
    assert imports, "the model bake's import is no longer found: update radixserve_imports"
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"no {module}.{name}"


def test_a_moved_import_is_caught() -> None:
    text = 'python -c "from radixserve.model_files.paths import resolve_model_path, gone"'
    imports = radixserve_imports(text)
    assert imports == [
        ("radixserve.model_files.paths", "resolve_model_path"),
        ("radixserve.model_files.paths", "gone"),
    ]
    module = importlib.import_module(imports[0][0])
    assert hasattr(module, "resolve_model_path") and not hasattr(module, "gone")


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[http.server.HTTPServer, type[_Metrics]]]:
    handler = type("Handler", (_Metrics,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> int:
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK), "--timeout-s", "2", *args],
        capture_output=True,
        timeout=30,
        env=env,
    )
    return result.returncode


def test_healthcheck_script_answers_like_the_service(
    metrics_server: tuple[http.server.HTTPServer, type[_Metrics]],
) -> None:
    server, handler = metrics_server
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    handler.body = b"# HELP radixserve:cache_config_info x\nradixserve:service_info 1.0\n"
    assert _healthcheck("--url", url) == 0
    # The worker is healthy only once its model is loaded (the metric has a series).
    assert _healthcheck("--url", url, "--require", "radixserve:cache_config_info") == 1
    handler.body += b'radixserve:cache_config_info{worker="w",page_size="1"} 1.0\n'
    assert _healthcheck("--url", url, "--require", "radixserve:cache_config_info") == 0
    # The URL from the environment, as in the images: the metrics port wins.
    assert _healthcheck(env={"RADIXSERVE_METRICS_PORT": str(port)}) == 0
    handler.status = 503  # the gateway's /health while draining
    assert _healthcheck(env={"RADIXSERVE_GATEWAY_PORT": str(port)}) == 1
    server.shutdown()
    server.server_close()
    assert _healthcheck("--url", url) == 1  # nothing listening
