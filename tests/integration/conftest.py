"""The gateway harness's and the front services' fixtures, for the integration tests only
(they need openai). A module's own fixture of the same name takes precedence."""

from tests.fixtures.front import bus, front, model_dir, tokenizer
from tests.fixtures.gateway import client, gateway, http, pipeline
from tests.fixtures.store import store
from tests.integration.stack_fixture import tiny_engine, tiny_model_dir, tiny_stack

__all__ = [
    "bus",
    "client",
    "front",
    "gateway",
    "http",
    "model_dir",
    "pipeline",
    "store",
    "tiny_engine",
    "tiny_model_dir",
    "tiny_stack",
    "tokenizer",
]
