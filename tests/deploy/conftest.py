"""`make test-compose`: each test's outcome kept on its item (the stack fixture dumps the
containers' logs after a failure), and the figures measured printed at the end."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

# What the run measured (seconds, sizes, versions), filled by test_compose_stack.py.
FIGURES: dict[str, Any] = {}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("compose stack figures")
    for key, value in FIGURES.items():
        terminalreporter.write_line(f"{key}: {value}")
