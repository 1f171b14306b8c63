"""Model fixtures for engine tests: tiny random-weight models and the embedded SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen3


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    # Two cores here; more threads only thrash, and xdist's workers share the cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 2) // workers)))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=1))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from radixserve.model_files.paths import resolve_model_path

    return Path(resolve_model_path(None))
