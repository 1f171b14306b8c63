"""Shared test configuration: registers the NATS/Redis fixtures for every test."""

from __future__ import annotations

import os

# Models are always local: never let transformers or huggingface_hub reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# The gateway fixtures (tests/fixtures/gateway.py, which imports openai) are imported by
# tests/integration/conftest.py, so the GPU machine, which lacks the HTTP stack, can run
# tests/gpu with this file.
pytest_plugins = ["tests.fixtures.servers"]
