"""The frontend language against the whole stack (`RuntimeEndpoint`: the gateway's
native `/generate`, real NATS and Redis, the six services as processes): the same
programs give what they give against the in-process engine on the same weights, a
batch of programs sharing a system prompt runs at once, and a request the server
refuses surfaces as a LangError with the server's message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import radixserve.lang as rl
from radixserve import Engine
from tests.integration.stack_fixture import RunningStack

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def endpoint(tiny_stack: RunningStack, tiny_model_dir: Path) -> Iterator[rl.RuntimeEndpoint]:
    backend = rl.RuntimeEndpoint(tiny_stack.url, model_path=str(tiny_model_dir), timeout_s=120)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def local(tiny_engine: Engine) -> rl.EngineBackend:
    return rl.EngineBackend(tiny_engine)


@rl.function
def triage(s: rl.ProgramState, ticket: str) -> None:
    s += rl.system("You sort support tickets.")
    s += rl.user(ticket)
    s += rl.assistant(
        "Category: "
        + rl.select("category", ["billing", "bug", "other"])
        + "\nSummary: "
        + rl.gen("summary", max_tokens=12, temperature=0)
    )


TICKETS = ["I was charged twice.", "The app crashes on start.", "Hello!", "Refund please."]


def test_programs_give_what_the_in_process_engine_gives(
    endpoint: rl.RuntimeEndpoint, local: rl.EngineBackend
) -> None:
    served = triage.run_batch([{"ticket": t} for t in TICKETS], backend=endpoint)
    expected = [triage.run(t, backend=local) for t in TICKETS]
    for got, want in zip(served, expected, strict=True):
        assert got["category"] in ("billing", "bug", "other")
        assert got.variables == want.variables
        assert got.messages() == want.messages()


def test_a_refused_request_is_a_lang_error_with_the_servers_message(
    endpoint: rl.RuntimeEndpoint,
) -> None:
    s = rl.ProgramState(endpoint)
    s += "Digits: "
    with pytest.raises(rl.LangError, match="answered 400: Regex parsing error"):
        s += rl.gen("bad", max_tokens=4, regex="[a-")


def test_an_unreachable_server_is_a_lang_error() -> None:
    backend = rl.RuntimeEndpoint("http://127.0.0.1:9", timeout_s=5)
    s = rl.ProgramState(backend)
    s += "Hi"
    with pytest.raises(rl.LangError, match=r"127\.0\.0\.1:9"):
        s += rl.gen("x", max_tokens=2)
    backend.close()
