"""The gateway harness's fixtures, for the integration tests only (they need openai)."""

from tests.fixtures.gateway import client, gateway, http, pipeline

__all__ = ["client", "gateway", "http", "pipeline"]
