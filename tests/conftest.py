"""Shared test configuration: registers the NATS/Redis fixtures for every test."""

from __future__ import annotations

pytest_plugins = ["tests.fixtures.servers"]
