"""The Grafana dashboards in `dashboards/`: valid dashboard JSON, and every query names
only metrics that radixserve's services declare.

No Grafana installs here (no Debian or PyPI package), so each dashboard is validated
against a JSON Schema of Grafana's dashboard model (schemaVersion 39, the classic
"v1" model that file provisioning reads), written down below from Grafana's documented
model: the dashboard and panel objects are closed (an unknown or misspelt key fails),
grid positions, datasource refs, templating and annotations are typed as Grafana
types them. Metric names come from the services' own registries, so a renamed metric
fails here; tests/integration/test_observability.py checks them against a live stack.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client import CollectorRegistry

from radixserve.telemetry.common import ServiceMetrics
from radixserve.telemetry.metrics import GatewayMetrics
from radixserve.telemetry.pipeline_metrics import (
    DetokenizerMetrics,
    GrammarMetrics,
    SchedulerMetrics,
    TokenizerMetrics,
)
from radixserve.worker.metrics import WorkerMetrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
METRIC = re.compile(r"radixserve:[a-zA-Z0-9_:]+")

_STRING_LIST = {"type": "array", "items": {"type": "string"}}
_DATASOURCE_REF = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"type": {"type": "string"}, "uid": {"type": "string"}},
}
_GRID_POS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["h", "w", "x", "y"],
    "properties": {
        "h": {"type": "integer", "exclusiveMinimum": 0},
        "w": {"type": "integer", "exclusiveMinimum": 0, "maximum": 24},
        "x": {"type": "integer", "minimum": 0, "exclusiveMaximum": 24},
        "y": {"type": "integer", "minimum": 0},
        "static": {"type": "boolean"},
    },
}
_FIELD_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "required": ["defaults", "overrides"],
    "properties": {
        "defaults": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "displayName": {"type": "string"},
                "description": {"type": "string"},
                "unit": {"type": "string"},
                "decimals": {"type": "number"},
                "min": {"type": "number"},
                "max": {"type": "number"},
                "mappings": {"type": "array"},
                "thresholds": {"type": "object"},
                "color": {"type": "object", "required": ["mode"]},
                "links": {"type": "array"},
                "noValue": {"type": "string"},
                "custom": {"type": "object"},
            },
        },
        "overrides": {"type": "array"},
    },
}
_PROMETHEUS_TARGET = {
    "type": "object",
    "required": ["refId", "expr", "datasource"],
    "properties": {
        "refId": {"type": "string", "minLength": 1},
        "expr": {"type": "string", "minLength": 1},
        "legendFormat": {"type": "string"},
        "datasource": _DATASOURCE_REF,
        "hide": {"type": "boolean"},
        "instant": {"type": "boolean"},
        "range": {"type": "boolean"},
        "interval": {"type": "string"},
        "format": {"enum": ["time_series", "table", "heatmap"]},
    },
    "additionalProperties": False,
}
_PANEL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "id", "gridPos", "title"],
    "properties": {
        "type": {"type": "string", "minLength": 1, "not": {"const": "row"}},
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "description": {"type": "string"},
        "pluginVersion": {"type": "string"},
        "tags": _STRING_LIST,
        "targets": {"type": "array", "items": _PROMETHEUS_TARGET},
        "transparent": {"type": "boolean"},
        "datasource": _DATASOURCE_REF,
        "gridPos": _GRID_POS,
        "links": {"type": "array"},
        "repeat": {"type": "string"},
        "repeatDirection": {"enum": ["h", "v"]},
        "maxPerRow": {"type": "number"},
        "maxDataPoints": {"type": "number"},
        "transformations": {"type": "array"},
        "interval": {"type": "string"},
        "timeFrom": {"type": "string"},
        "timeShift": {"type": "string"},
        "hideTimeOverride": {"type": "boolean"},
        "options": {"type": "object"},
        "fieldConfig": _FIELD_CONFIG,
    },
}
_ROW = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "collapsed", "id", "panels"],
    "properties": {
        "type": {"const": "row"},
        "collapsed": {"type": "boolean"},
        "title": {"type": "string"},
        "datasource": _DATASOURCE_REF,
        "gridPos": _GRID_POS,
        "id": {"type": "integer"},
        "panels": {"type": "array", "items": _PANEL},
        "repeat": {"type": "string"},
    },
}
_VARIABLE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "name"],
    "properties": {
        "type": {
            "enum": [
                "query",
                "adhoc",
                "constant",
                "datasource",
                "interval",
                "textbox",
                "custom",
                "system",
            ]
        },
        "name": {"type": "string"},
        "label": {"type": "string"},
        "hide": {"enum": [0, 1, 2]},
        "skipUrlSync": {"type": "boolean"},
        "description": {"type": "string"},
        "query": {"type": ["string", "object"]},
        "datasource": _DATASOURCE_REF,
        "current": {
            "type": "object",
            "required": ["text", "value"],
            "properties": {
                "selected": {"type": "boolean"},
                "text": {"type": ["string", "array"]},
                "value": {"type": ["string", "array"]},
            },
        },
        "multi": {"type": "boolean"},
        "options": {"type": "array"},
        "refresh": {"enum": [0, 1, 2]},
        "sort": {"enum": [0, 1, 2, 3, 4, 5, 6, 7, 8]},
    },
}
_ANNOTATION = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "datasource", "enable", "iconColor"],
    "properties": {
        "name": {"type": "string"},
        "datasource": _DATASOURCE_REF,
        "enable": {"type": "boolean"},
        "hide": {"type": "boolean"},
        "iconColor": {"type": "string"},
        "filter": {"type": "object"},
        "target": {"type": "object"},
        "type": {"type": "string"},
        "builtIn": {"type": "number"},
        "expr": {"type": "string"},
    },
}
GRAFANA_DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "additionalProperties": False,
    "required": ["schemaVersion", "templating", "annotations", "uid", "title", "panels"],
    "properties": {
        "id": {"type": ["integer", "null"]},
        "uid": {"type": "string", "minLength": 1, "maxLength": 40},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "revision": {"type": "integer"},
        "gnetId": {"type": "string"},
        "tags": _STRING_LIST,
        "timezone": {"type": "string"},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "time": {
            "type": "object",
            "additionalProperties": False,
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "timepicker": {"type": "object"},
        "fiscalYearStartMonth": {"type": "integer", "minimum": 0, "maximum": 11},
        "liveNow": {"type": "boolean"},
        "weekStart": {"type": "string"},
        "refresh": {"anyOf": [{"type": "string"}, {"const": False}]},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "version": {"type": "integer"},
        "panels": {"type": "array", "items": {"anyOf": [_PANEL, _ROW]}},
        "templating": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"list": {"type": "array", "items": _VARIABLE}},
        },
        "annotations": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"list": {"type": "array", "items": _ANNOTATION}},
        },
        "links": {"type": "array"},
    },
}


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def panels_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_metric_names() -> set[str]:
    """Every `radixserve:` name that a panel query of a dashboard uses."""
    names: set[str] = set()
    for path in dashboard_files():
        for panel in panels_of(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                names.update(METRIC.findall(target["expr"]))
    return names


def declared_sample_names() -> set[str]:
    """What the services' registries can expose: each family's sample names."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "info": ("_info",),
    }

    def common(service: str) -> ServiceMetrics:
        return ServiceMetrics(service, f"{service}-0", CollectorRegistry())

    services = [
        GatewayMetrics(common=common("gateway")),
        TokenizerMetrics(common("tokenizer")),
        SchedulerMetrics(common("scheduler")),
        GrammarMetrics(common("grammar")),
        DetokenizerMetrics(common("detokenizer")),
        WorkerMetrics(common("worker"), "worker-0"),
    ]
    registries = [metrics.common.registry for metrics in services]
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_there_are_dashboards_with_the_panels_the_issue_asks_for() -> None:
    files = dashboard_files()
    assert files, "no dashboards in dashboards/"
    titles = {p["title"] for path in files for p in panels_of(json.loads(path.read_text()))}
    for wanted in (
        "Time to first token",
        "Time per output token",
        "Requests per second by status",
        "Tokens per second",
        "Queue depth by worker",
        "Running requests by worker",
        "KV cache usage by worker",
        "Prefix cache hit rate",
        "Generated tokens per second by worker",
        "Errors by type",
        "Finish reasons",
        "Step time by worker",
    ):
        assert wanted in titles


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_dashboard_is_valid_grafana_dashboard_json(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    jsonschema.validate(dashboard, GRAFANA_DASHBOARD_SCHEMA)
    panels = panels_of(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    # No two panels on the same cells (a copy of a panel once sat on top of another).
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']} has no query"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
            for target in panel["targets"]:
                assert _balanced(target["expr"]), target["expr"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$\{?(\w+)\}?", json.dumps(dashboard))) - {"__rate_interval"}
    assert used <= variables, f"undefined variables {used - variables}"


def test_the_schema_rejects_what_grafana_would() -> None:
    path = dashboard_files()[0]
    good = json.loads(path.read_text())
    for broken in (
        {**good, "schemaVersion": "39"},
        {**good, "pannels": good["panels"]},
        {k: v for k, v in good.items() if k != "templating"},
        {**good, "panels": [{**good["panels"][1], "gridPos": {"h": 8, "w": 30, "x": 0, "y": 0}}]},
        {**good, "panels": [{**good["panels"][1], "targets": [{"refId": "A"}]}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, GRAFANA_DASHBOARD_SCHEMA)


def test_every_dashboard_query_names_a_declared_metric() -> None:
    used = dashboard_metric_names()
    assert used
    unknown = used - declared_sample_names()
    assert not unknown, f"dashboards query undeclared metrics: {sorted(unknown)}"


def _balanced(expr: str) -> bool:
    depth = 0
    for char in expr:
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0
