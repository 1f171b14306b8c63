"""Render the Helm chart and check what it renders, with no helm binary and no cluster.

    manifests = render_chart(CHART_DIR, {"worker": {"gpu": {"enabled": True}}})
    render_notes(CHART_DIR)                 # what `helm install` prints (NOTES.txt)
    strict_errors(manifests, "1.37")        # [] when every object passes strict validation
    container_violations(manifests)         # [] when every container meets the policy
    ingress_sources(manifests, labels, port)  # who the NetworkPolicies let reach a port
    chart = chart_copy(tmp_path)            # a copy to break on purpose
    edit_file(chart / "templates" / "nats.yaml", "replicas: 1", 'replicas: "one"')

Rendering is Helm's own engine in-process (helm-python-sdk); validation is
kubernetes-validate's bundled OpenAPI schemas in strict mode (unknown fields are errors).
Custom resources (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor) have no
bundled schema: `crd_errors` checks the fields the chart relies on.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "radixserve"
GPU_VALUES = CHART_DIR / "values-gpu.yaml"
RELEASE = "rs"
NAMESPACE = "llm"
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest bundled.
KUBE_VERSIONS = ("1.27", kubernetes_validate.latest_version())

helm.disable_logging()


@dataclass(frozen=True)
class Manifest:
    source: str  # the template file it came from
    body: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.body.get('kind')}/{self.body.get('metadata', {}).get('name')}"


def load_values(path: Path) -> dict[str, Any]:
    return helm.values_from_yaml(path.read_text())


def _render(chart_dir: Path, values: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(chart_dir) as chart:
        rendered: dict[str, str] = chart.render(
            values=values, name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    return rendered


def render_chart(chart_dir: Path, values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every object the chart renders (raises helm's error on bad values or templates)."""
    rendered = _render(chart_dir, values)
    manifests = []
    for source, text in sorted(rendered.items()):
        if not source.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for body in yaml.safe_load_all(text):
            if body:
                manifests.append(Manifest(source, body))
    return manifests


def render_notes(chart_dir: Path, values: dict[str, Any] | None = None) -> str:
    """What `helm install` prints after it (templates/NOTES.txt)."""
    return next(
        text for source, text in _render(chart_dir, values).items() if source.endswith("NOTES.txt")
    )


def lint_errors(chart_dir: Path, values: dict[str, Any] | None = None) -> list[str]:
    """`helm lint --strict`: warnings and errors (not the informational notes)."""
    report = helm.lint(chart_dir, values, strict=True)
    messages = [m["error"] for m in report["messages"] if m["severity"] >= 2]
    return messages + list(report["errors"])


# Custom resources: what the chart relies on, checked by hand (no schema is bundled).
CRD_REQUIRED: dict[str, list[tuple[str, ...]]] = {
    "ScaledObject": [
        ("spec", "scaleTargetRef", "name"),
        ("spec", "minReplicaCount"),
        ("spec", "maxReplicaCount"),
        ("spec", "triggers"),
    ],
    "ServiceMonitor": [("spec", "selector", "matchLabels"), ("spec", "endpoints")],
}
CRD_API_VERSIONS = {
    "ScaledObject": "keda.sh/v1alpha1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
}


def strict_errors(manifests: list[Manifest], version: str) -> list[str]:
    """Strict schema validation of every built-in object against Kubernetes `version`."""
    errors = []
    for manifest in manifests:
        if manifest.body.get("kind") in CRD_REQUIRED:
            errors += crd_errors(manifest)
            continue
        try:
            kubernetes_validate.validate(manifest.body, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{manifest.name} ({manifest.source}) {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{manifest.name} ({manifest.source}): no schema: {exc.message}")
    return errors


def crd_errors(manifest: Manifest) -> list[str]:
    kind = manifest.body["kind"]
    errors = []
    if manifest.body.get("apiVersion") != CRD_API_VERSIONS[kind]:
        errors.append(f"{manifest.name}: apiVersion {manifest.body.get('apiVersion')}")
    for path in CRD_REQUIRED[kind]:
        node: Any = manifest.body
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node in (None, "", [], {}):
            errors.append(f"{manifest.name}: {'.'.join(path)} is missing")
    return errors


def pod_specs(manifest: Manifest) -> Iterator[dict[str, Any]]:
    """The pod specs of a workload object (Deployment, StatefulSet, Job, CronJob, Pod...)."""
    body = manifest.body
    if body.get("kind") == "Pod":
        yield body["spec"]
        return
    spec = body.get("spec", {})
    if body.get("kind") == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    template = spec.get("template", {}).get("spec")
    if template is not None:
        yield template


# Containers whose root filesystem must stay writable, with the reason (none so far).
WRITABLE_ROOT: dict[str, str] = {}
PINNED_IMAGE = re.compile(r"^[^:@\s]+(:[^:@\s]+|@sha256:[0-9a-f]{64})$")


def container_violations(manifests: list[Manifest]) -> list[str]:
    """Every container of every workload: requests and limits, probes, non-root, no
    privilege escalation, all capabilities dropped, a read-only root filesystem, a
    pinned image."""
    problems = []
    for manifest in manifests:
        for pod in pod_specs(manifest):
            pod_security = pod.get("securityContext", {})
            containers = pod.get("initContainers", []) + pod.get("containers", [])
            for container in containers:
                where = f"{manifest.name} container {container.get('name')}"
                problems += [f"{where}: {p}" for p in _container_problems(container, pod_security)]
    return problems


def _container_problems(container: dict[str, Any], pod_security: dict[str, Any]) -> list[str]:
    problems = []
    resources = container.get("resources", {})
    for kind in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            if resource not in resources.get(kind, {}):
                problems.append(f"no {resource} {kind[:-1]}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe not in container:
            problems.append(f"no {probe}")
    security = {**pod_security, **container.get("securityContext", {})}
    if security.get("runAsNonRoot") is not True:
        problems.append("runAsNonRoot is not true")
    if security.get("runAsUser") == 0:
        problems.append("runs as uid 0")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation is not false")
    if security.get("privileged"):
        problems.append("privileged")
    if "ALL" not in security.get("capabilities", {}).get("drop", []):
        problems.append("capabilities are not all dropped")
    if (
        security.get("readOnlyRootFilesystem") is not True
        and container["name"] not in WRITABLE_ROOT
    ):
        problems.append("root filesystem is writable")
    image = str(container.get("image", ""))
    if not PINNED_IMAGE.match(image) or image.endswith(":latest"):
        problems.append(f"image {image!r} is not pinned to a tag or digest")
    return problems


def by_kind(manifests: list[Manifest], kind: str) -> dict[str, dict[str, Any]]:
    return {m.body["metadata"]["name"]: m.body for m in manifests if m.body.get("kind") == kind}


def component_of(body: dict[str, Any]) -> str:
    return str(body["metadata"]["labels"]["app.kubernetes.io/component"])


def env_values(container: dict[str, Any]) -> dict[str, str]:
    """A container's variables that have a value (not those read from a Secret)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def chart_copy(tmp_path: Path) -> Path:
    """A copy of the chart to break on purpose."""
    target = tmp_path / "radixserve"
    shutil.copytree(CHART_DIR, target, symlinks=False)  # the dashboards link, resolved
    return target


def edit_file(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path.name}: update the test with the template"
    path.write_text(text.replace(old, new, 1))


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
        if operator == "NotIn" and labels.get(key) in expression["values"]:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def ingress_sources(
    manifests: list[Manifest], labels: dict[str, str], port: dict[str, Any]
) -> list[list[dict[str, Any]] | None]:
    """Who the NetworkPolicies let reach a container `port` ({name, containerPort}) of
    a pod with `labels`: the `from` of every rule that admits the port, None for a rule
    without `from` (anyone). [] when none does: the chart's default-deny selects every
    pod of the release, so the port is closed."""
    sources: list[list[dict[str, Any]] | None] = []
    for policy in by_kind(manifests, "NetworkPolicy").values():
        spec = policy["spec"]
        if "Ingress" not in spec.get("policyTypes", []) or not selects(spec["podSelector"], labels):
            continue
        for rule in spec.get("ingress", []):
            ports = rule.get("ports")
            if ports is None or any(
                p.get("port") in (port["name"], port["containerPort"]) for p in ports
            ):
                sources.append(rule.get("from"))
    return sources


def pod_ports(manifests: list[Manifest]) -> Iterator[tuple[str, dict[str, str], dict[str, Any]]]:
    """(component, pod labels, container port) of every workload's every port."""
    for manifest in manifests:
        for pod in pod_specs(manifest):
            labels = manifest.body["spec"]["template"]["metadata"]["labels"]
            for container in pod.get("containers", []):
                for port in container.get("ports", []):
                    yield labels["app.kubernetes.io/component"], labels, port
