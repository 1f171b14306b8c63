"""GPU tests run only where CUDA is available; elsewhere the whole folder skips."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
