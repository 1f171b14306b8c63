"""What the packaging tests read, made once: the chart rendered, docker-compose.yml
loaded."""

from __future__ import annotations

from typing import Any

import pytest

from tests.packaging.chart_values import VALUE_SETS
from tests.packaging.compose_checks import COMPOSE_FILE, load_compose
from tests.packaging.kube import CHART_DIR, Manifest, render_chart


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Manifest]]:
    """The chart rendered with each of VALUE_SETS, by name (read, never changed)."""
    return {name: render_chart(CHART_DIR, make()) for name, make in VALUE_SETS.items()}


@pytest.fixture(scope="session")
def compose_model() -> dict[str, Any]:
    """docker-compose.yml as `docker compose config` gives it (read, never changed)."""
    return load_compose(COMPOSE_FILE.read_text())
