"""Grammar compiles in child processes: the same entries as an in-thread compile, a
compile past the limit stopped (its process killed and started again) and refused, a
dead process replaced, and the registry's answers around them.

Real xgrammar and the SmolLM2 tokenizer in real child processes. The slow grammar is a
JSON schema whose string pattern is `^.{0,6000}$`: xgrammar expands the repetition,
~15 s on the 2-core dev box (3000: 3 s, 9000: 34 s), so a 1.5 s limit always stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.grammar import GrammarSource
from radixserve.grammar.compile import XGrammarCompiler
from radixserve.grammar.entry import GrammarEntry
from radixserve.grammar.processes import (
    CompileProcesses,
    CompilerSpec,
    CompilerUnavailable,
    too_long_message,
)
from radixserve.grammar.registry import GrammarRegistry, RegistrySettings, entry_builder
from radixserve.protocol import GrammarCompileRequest, GrammarFetchRequest
from tests.helpers.tiny_models import embedded_model_dir

TOKENIZER_ID = "tok-test"
LIMIT_S = 1.5
STOPPED_TTL_S = 4.0
SLOW = GrammarSource(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": "^.{0,6000}$"}},
            "required": ["a"],
        }
    ),
)
QUICK = GrammarSource("regex", "[0-9]{3}")
STOPS: list[str] = []  # the kinds the pool reported stopped (its on_stop)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model_files.tokenizer import load_tokenizer

    return load_tokenizer(Path(embedded_model_dir()))


@pytest.fixture(scope="module")
def processes(tokenizer: Any) -> Iterator[CompileProcesses]:
    spec = CompilerSpec(str(embedded_model_dir()), TOKENIZER_ID, len(tokenizer))
    pool = CompileProcesses(spec, processes=1, limit_s=LIMIT_S, on_stop=STOPS.append)
    yield pool
    pool.close()
    assert pool.pids == [None]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0 until it is reaped; /proc tells it apart.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _pid(pool: CompileProcesses) -> int:
    pid = pool.pids[0]
    assert pid is not None
    return pid


@pytest.mark.slow
def test_entries_equal_the_in_thread_compile(processes: CompileProcesses, tokenizer: Any) -> None:
    local = entry_builder(XGrammarCompiler.for_tokenizer(tokenizer, len(tokenizer)), TOKENIZER_ID)
    sources = [
        QUICK,
        GrammarSource("json_schema", json.dumps({"type": "object", "properties": {}})),
        GrammarSource("ebnf", 'root ::= "yes" | "no"'),
        GrammarSource("regex", "[a-"),  # refused by the compiler: the same refusal
    ]
    for source in sources:
        entry = processes(source)
        assert entry == local(source), source
    refusal = processes(GrammarSource("regex", "[a-")).error
    assert refusal is not None and "Unclosed" in refusal


@pytest.mark.slow
def test_a_compile_past_the_limit_is_stopped_and_refused(processes: CompileProcesses) -> None:
    pid = _pid(processes)
    stopped, restarts = processes.counters.stopped, processes.counters.restarts
    started = time.monotonic()
    entry = processes(SLOW)
    took = time.monotonic() - started
    assert entry.error == too_long_message(LIMIT_S) and entry.artifact is None
    assert LIMIT_S <= took < LIMIT_S + 5
    assert processes.counters.stopped == stopped + 1 and STOPS[-1] == "json_schema"
    assert _gone(pid)  # killed, not left compiling
    # The next compile waits for the new process, and it compiles.
    assert processes(QUICK).ok
    assert processes.counters.restarts == restarts + 1
    assert _pid(processes) != pid


@pytest.mark.slow
def test_a_process_that_died_is_replaced(processes: CompileProcesses) -> None:
    # Killed while idle: the next compile starts a new one.
    pid = _pid(processes)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes(QUICK).ok and _pid(processes) != pid
    # Killed in the middle of a compile: the compile runs again in a new process (here
    # to the limit, which stops it).
    pid = _pid(processes)
    restarts = processes.counters.restarts
    outcome: list[BaseException | GrammarEntry] = []

    def compile_slow() -> None:
        try:
            outcome.append(processes(SLOW))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=compile_slow)
    thread.start()
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], GrammarEntry)
    assert outcome[0].error == too_long_message(LIMIT_S)
    assert processes(QUICK).ok and _pid(processes) != pid
    assert processes.counters.restarts == restarts + 2  # after the kill, after the stop


def test_a_process_that_cannot_start_is_an_error(tmp_path: Path) -> None:
    spec = CompilerSpec(str(tmp_path / "no-model"), TOKENIZER_ID, 100)
    with pytest.raises(CompilerUnavailable, match="did not start"):
        CompileProcesses(spec, processes=1, limit_s=LIMIT_S, start_timeout_s=60)


@pytest.mark.slow
async def test_registry_refuses_a_stopped_grammar_and_remembers(
    processes: CompileProcesses,
) -> None:
    registry = GrammarRegistry(
        build=processes,
        tokenizer_id=TOKENIZER_ID,
        settings=RegistrySettings(compile_timeout_s=0.3, stopped_ttl_s=STOPPED_TTL_S),
    )
    request = GrammarCompileRequest(
        rid="r", kind=SLOW.kind, source=SLOW.source, tokenizer_id=TOKENIZER_ID
    )
    first = await registry.compile(request)
    assert (first.ok, first.code) == (False, "grammar_unavailable")  # past the soft timeout
    # The compile goes on until the limit stops it; retries join it meanwhile.
    deadline = time.monotonic() + LIMIT_S + 15
    refused = first
    while refused.code == "grammar_unavailable" and time.monotonic() < deadline:
        refused = await registry.compile(request)
    assert (refused.ok, refused.code) == (False, "invalid_grammar")
    assert refused.error == too_long_message(LIMIT_S)
    refused_at = time.monotonic()
    assert registry.counters.compiled == 1  # the retry did not compile again
    fetched = await registry.fetch(GrammarFetchRequest(rid="f", key=refused.key))
    assert (fetched.ok, fetched.code) == (False, "invalid_grammar")
    # The replacement process (ready in a few seconds: past the soft timeout, the
    # answer is "retry later") compiles the next grammar.
    quick = GrammarCompileRequest(
        rid="q", kind="regex", source="[ab]{2}", tokenizer_id=TOKENIZER_ID
    )
    deadline = time.monotonic() + 60
    ok = await registry.compile(quick)
    while ok.code == "grammar_unavailable" and time.monotonic() < deadline:
        ok = await registry.compile(quick)
    assert ok.ok
    # The refusal lasts STOPPED_TTL_S: then the grammar is compiled again (and stopped
    # again, in the background).
    compiled = registry.counters.compiled
    await asyncio.sleep(max(0.0, refused_at + STOPPED_TTL_S + 0.1 - time.monotonic()))
    again = await registry.compile(request)
    assert (again.ok, again.code) == (False, "grammar_unavailable")
    assert registry.counters.compiled == compiled + 1
    await registry.close()


@pytest.mark.slow
async def test_the_service_registry_compiles_in_processes_or_threads() -> None:
    from radixserve.grammar.setup import registry_for_model

    quick = GrammarCompileRequest(rid="r", kind="regex", source="[xy]{2}", tokenizer_id="")
    for limit_s in (LIMIT_S, 0.0):
        registry = await asyncio.to_thread(
            registry_for_model, None, remote=None, compile_limit_s=limit_s, compile_workers=1
        )
        build = registry.build
        assert isinstance(build, CompileProcesses) == (limit_s > 0)
        reply = await registry.compile(
            msgspec.structs.replace(quick, tokenizer_id=registry.tokenizer_id)
        )
        assert reply.ok, reply
        await registry.close()
        if isinstance(build, CompileProcesses):
            assert build.pids == [None]  # close() ended its process


@pytest.mark.slow
def test_a_child_ends_when_its_parent_dies_mid_compile(tmp_path: Path, tokenizer: Any) -> None:
    # A parent process starts the pool and a compile that takes ~15 s, then is killed:
    # its child must not compile on as an orphan.
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        "from radixserve.grammar.processes import CompileProcesses, CompilerSpec\n"
        "from radixserve.grammar.source import GrammarSource\n"
        f"spec = CompilerSpec({str(embedded_model_dir())!r}, 'tok', {len(tokenizer)})\n"
        "pool = CompileProcesses(spec, processes=1, limit_s=120)\n"
        f"slow = GrammarSource('json_schema', {SLOW.source!r})\n"
        "threading.Thread(target=pool, args=(slow,), daemon=True).start()\n"
        "print(pool.pids[0], flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the compile is under way
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(child):
            assert time.monotonic() < deadline, "the orphaned child kept compiling"
            time.sleep(0.1)
    finally:
        parent.kill()
