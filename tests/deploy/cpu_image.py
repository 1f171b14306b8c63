"""The CPU image compose runs, built on the stand-ins (tests/deploy/standin_images.py).

The CPU image (`radixserve:0.1.0`, compose's `x-radixserve` default) is built from
docker/Dockerfile as it is, its torch from a PEP 503 index served on 127.0.0.1 (the CPU
wheel on this machine's disk, /opt/wheels, and the wheels torch depends on, from PyPI):
`docker build --network host --build-arg TORCH_INDEX_URL=http://127.0.0.1:PORT/simple`.
The port is fixed (the build argument is part of the cache key of the torch layer).

Docker's classic builder (DOCKER_BUILDKIT=0, `standin_images.docker_env`) for the same
reason as the stand-ins. Standard library only; every command has a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.deploy.standin_images import (
    RADIXSERVE_IMAGE,
    REPO,
    WORK_DIR,
    Figures,
    compose_images,
    docker_env,
    ensure_standins,
    image_exists,
    log,
    run,
)

WHEELS_DIR = Path(os.environ.get("RADIXSERVE_TORCH_WHEELS", "/opt/wheels"))
TORCH_INDEX_PORT = int(os.environ.get("RADIXSERVE_TORCH_INDEX_PORT", "38765"))
IMAGE_BUILD_TIMEOUT_S = int(os.environ.get("RADIXSERVE_IMAGE_BUILD_TIMEOUT_S", "5400"))
PIP_DOWNLOAD_TIMEOUT_S = 1800


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_project(filename: str) -> str:
    return _normalize(filename.split("-", 1)[0])


def torch_requirement(dockerfile: Path) -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not match:
        raise RuntimeError(f"no `ARG TORCH_VERSION=` default in {dockerfile}")
    return f"torch=={match.group(1)}+cpu"


def build_torch_index(requirement: str) -> Path:
    """A PEP 503 index of the CPU torch wheel and the wheels it depends on: its root."""
    root = WORK_DIR / "torch-index"
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    version = requirement.split("==", 1)[1]
    if not list(files.glob(f"torch-{version}-*.whl")):
        local = version.split("+", 1)[0]
        disk = sorted(WHEELS_DIR.glob(f"torch-{version}-*.whl")) or sorted(
            WHEELS_DIR.glob(f"torch-{local}-*.whl")
        )
        if not disk:
            raise RuntimeError(f"no torch {local} wheel in {WHEELS_DIR}")
        wheel = disk[0]
        # pip matches `torch==X+cpu` to the version in the file name: give it the +cpu one.
        target = (
            wheel.name
            if f"-{version}-" in wheel.name
            else wheel.name.replace(f"-{local}-", f"-{version}-", 1)
        )
        log(f"torch wheel {wheel} served as {target}")
        shutil.copyfile(wheel, files / target)
    marker = files / ".deps-done"
    if not marker.exists():
        # Its dependencies, for this CPython and platform (the image's is the same: 3.11,
        # glibc x86_64); pip takes torch itself from the copy above.
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--only-binary=:all:",
                requirement,
                "--find-links",
                str(files),
                "--dest",
                str(files),
            ],
            PIP_DOWNLOAD_TIMEOUT_S,
            log_file=WORK_DIR / "pip-download.log",
        )
        marker.touch()
    simple = root / "simple"
    shutil.rmtree(simple, ignore_errors=True)
    projects: dict[str, list[str]] = {}
    for wheel in sorted(files.glob("*.whl")):
        projects.setdefault(_wheel_project(wheel.name), []).append(wheel.name)
    for project, names in projects.items():
        (simple / project).mkdir(parents=True)
        links = "".join(
            f'<a href="../../files/{urllib.parse.quote(n)}">{html.escape(n)}</a><br>\n'
            for n in names
        )
        (simple / project / "index.html").write_text(
            f"<!DOCTYPE html><html><body>\n{links}</body></html>\n"
        )
    index = "".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{index}</body></html>\n")
    return root


@contextlib.contextmanager
def serve_directory(root: Path, port: int) -> Iterator[str]:
    """`python -m http.server` on 127.0.0.1:`port` for the block: its base URL."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"127.0.0.1:{port} is taken: set RADIXSERVE_TORCH_INDEX_PORT")
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "-d", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/simple/", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the index server on {url} did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def build_radixserve_image(
    repo: Path = REPO, tag: str | None = None, figures: Figures | None = None
) -> Figures:
    """docker/Dockerfile built as it is (the classic builder's cache makes an unchanged
    tree a matter of seconds), torch from the index above."""
    figures = figures or Figures()
    tag = tag or compose_images(repo).get("gateway") or RADIXSERVE_IMAGE
    dockerfile = repo / "docker/Dockerfile"
    index = build_torch_index(torch_requirement(dockerfile))
    with serve_directory(index, TORCH_INDEX_PORT) as url:
        started = time.monotonic()
        run(
            [
                "docker",
                "build",
                "--force-rm",  # a failed step's container removed too (the classic builder)
                "--network",
                "host",
                "--build-arg",
                f"TORCH_INDEX_URL={url}/simple",
                "-f",
                str(dockerfile),
                "-t",
                tag,
                str(repo),
            ],
            IMAGE_BUILD_TIMEOUT_S,
            env=docker_env(),
            log_file=WORK_DIR / "build-radixserve.log",
        )
        figures.image_build_s = round(time.monotonic() - started, 1)
    size = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Size}}", tag],
        capture_output=True,
        timeout=60,
        check=True,
    )
    figures.image_size_bytes = int(size.stdout.decode().strip())
    return figures


def ensure_all(repo: Path = REPO, build_image: bool = True) -> Figures:
    figures = ensure_standins(repo)
    if build_image:
        tag = compose_images(repo).get("gateway") or RADIXSERVE_IMAGE
        if os.environ.get("RADIXSERVE_REBUILD_IMAGE", "1") != "0" or not image_exists(tag):
            build_radixserve_image(repo, tag, figures)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--no-image", action="store_true", help="only the stand-ins")
    ns = parser.parse_args(argv)
    figures = ensure_all(REPO, build_image=not ns.no_image)
    print(json.dumps(figures.__dict__, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
