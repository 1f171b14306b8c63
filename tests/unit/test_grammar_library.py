"""The grammar library: compile, serialize, cache (memory LRU + the registry's rules),
the worker's loader, and the protocol / prep / API pieces around them.

xgrammar is real throughout (the SmolLM2 tokenizer); the registry's compile function
is replaced by slow or counting ones only where the test is about timing or dedup.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.grammar import GrammarSource, InvalidGrammar
from radixserve.grammar.artifact import ArtifactMismatch, artifact_format, deserialize, serialize
from radixserve.grammar.compile import (
    BOUNDED_STRING_CHARS,
    JSON_SAFE_CHARS,
    MAX_PATTERN_BOUND,
    XGrammarCompiler,
    clean_error,
    json_safe_lengths,
    json_schema_grammar,
)
from radixserve.grammar.entry import GrammarEntry
from radixserve.grammar.lru import BoundedLru
from radixserve.grammar.registry import GrammarRegistry, RegistrySettings, entry_builder
from radixserve.protocol import (
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    SamplingParams,
    TokenizedRequest,
    decode,
    encode,
    grammar_key,
    pack_tokens,
)
from tests.helpers.tiny_models import embedded_model_dir

TOKENIZER_ID = "tok-test"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radixserve.model_files.tokenizer import load_tokenizer

    return load_tokenizer(Path(embedded_model_dir()))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> XGrammarCompiler:
    return XGrammarCompiler.for_tokenizer(tokenizer, len(tokenizer))


# -- compile ----------------------------------------------------------------------------------


def test_every_kind_compiles_and_constrains(compiler: XGrammarCompiler) -> None:
    import xgrammar as xgr

    cases = [
        (
            "json_schema",
            json.dumps(
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            ),
            '{"a": 12}',
            '{"a": "x"}',
        ),
        ("regex", r"[0-9]{3}-[a-z]{2}", "123-ab", "12-ab"),
        ("ebnf", 'root ::= "yes" | "no"', "yes", "maybe"),
        (
            "structural_tag",
            json.dumps(
                {
                    "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
                    "triggers": ["<f>"],
                }
            ),
            "text <f>42</f>",
            "text <f>x",
        ),
    ]
    for kind, source, good, bad in cases:
        compiled = compiler.compile(GrammarSource(kind, source))  # type: ignore[arg-type]
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(good), (kind, good)
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), (kind, bad)


def test_json_is_compact_so_output_must_end(compiler: XGrammarCompiler) -> None:
    import xgrammar as xgr

    compiled = compiler.compile(
        GrammarSource(
            "json_schema", '{"type": "array", "items": {"type": "boolean"}, "maxItems": 2}'
        )
    )
    assert xgr.GrammarMatcher(compiled).accept_string("[true, false]")
    assert not xgr.GrammarMatcher(compiled).accept_string("[ true")  # no free whitespace


def test_length_bounded_strings_hold_no_raw_control_characters(compiler: XGrammarCompiler) -> None:
    import xgrammar as xgr

    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 4}},
        "required": ["s"],
    }
    compiled = compiler.compile(GrammarSource("json_schema", json.dumps(schema)))
    assert xgr.GrammarMatcher(compiled).accept_string('{"s": "abcd"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "abcde')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "a\x15')
    # Only plain length-bounded strings change; a property named like a keyword does not.
    rewritten = json.loads(
        json_safe_lengths(
            {
                "type": "object",
                "properties": {
                    "maxLength": {"type": "integer"},
                    "p": {"type": "string", "pattern": "^a$", "maxLength": 3},
                },
            }
        )
    )
    assert rewritten["properties"] == {
        "maxLength": {"type": "integer"},
        "p": {"type": "string", "pattern": "^a$", "maxLength": 3},
    }


@pytest.mark.parametrize("bound", [MAX_PATTERN_BOUND + 1, 5000])
def test_large_length_bounds_stay_repetitions_without_raw_control_characters(
    compiler: XGrammarCompiler, bound: int
) -> None:
    import xgrammar as xgr

    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": bound}},
        "required": ["s"],
    }
    # Left to xgrammar (a pattern of that bound would be expanded: seconds to compile),
    # its character rule narrowed: an xgrammar that prints the rule otherwise fails here.
    assert json.loads(json_safe_lengths(schema))["properties"]["s"] == schema["properties"]["s"]
    ebnf = json_schema_grammar(schema)
    assert JSON_SAFE_CHARS in ebnf and BOUNDED_STRING_CHARS not in ebnf
    assert f"{{0, {bound}}}" in ebnf
    compiled = compiler.compile(GrammarSource("json_schema", json.dumps(schema)))
    assert xgr.GrammarMatcher(compiled).accept_string('{"s": "' + "a" * bound + '"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "' + "a" * (bound + 1))
    for raw in ("\t", "\n", "\x15", "\\"):
        assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "a' + raw)


@pytest.mark.parametrize(
    ("kind", "source", "message"),
    [
        ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
        ("json_schema", "{oops", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be an object"),
        ("regex", "[a-", "Unclosed '['"),
        ("ebnf", "root ::= missing", 'Rule "missing" is not defined'),
        ("structural_tag", '{"structures": [{"begin": "<f>"}]}', "begin, schema and end"),
    ],
)
def test_refusals_carry_the_compilers_reason(
    compiler: XGrammarCompiler, kind: str, source: str, message: str
) -> None:
    with pytest.raises(InvalidGrammar) as info:
        compiler.compile(GrammarSource(kind, source))  # type: ignore[arg-type]
    assert info.value.kind == kind and message in info.value.message
    assert "/project/cpp" not in info.value.message and "\n" not in info.value.message


def test_clean_error_drops_the_cpp_prefix() -> None:
    raw = "[15:26:41] /project/cpp/regex_converter.cc:83: Regex parsing error at position 4\nmore"
    assert clean_error(raw) == "Regex parsing error at position 4"


# -- artifacts --------------------------------------------------------------------------------


def test_artifact_round_trip_and_mismatch(compiler: XGrammarCompiler, tokenizer: Any) -> None:
    import xgrammar as xgr

    compiled = compiler.compile(GrammarSource("regex", "[a-c]{2}"))
    blob = serialize(compiled)
    loaded = deserialize(blob, compiler.info, artifact_format())
    assert xgr.GrammarMatcher(loaded).accept_string("ab")
    assert not xgr.GrammarMatcher(loaded).accept_string("ad")
    padded = XGrammarCompiler.for_tokenizer(tokenizer, len(tokenizer) + 64).info
    with pytest.raises(ArtifactMismatch):
        deserialize(blob, padded)  # another vocabulary size: the worker compiles instead
    with pytest.raises(ArtifactMismatch):
        deserialize(blob, compiler.info, "xgrammar-v0+zlib")
    with pytest.raises(ArtifactMismatch):
        deserialize(b"not zlib", compiler.info)


def test_bounded_lru_evicts_by_count_and_size() -> None:
    lru: BoundedLru[bytes] = BoundedLru(max_entries=3, max_bytes=10, size_of=len)
    for key in "abc":
        lru.put(key, b"xx")
    assert lru.get("a") == b"xx"  # refreshed: b is now the oldest
    lru.put("d", b"xx")
    assert "b" not in lru and len(lru) == 3
    lru.put("e", b"x" * 8)  # 2 + 2 + 2 + 8 > 10: the oldest go until it fits
    assert lru.total_bytes <= 10 and "e" in lru
    lru.put("huge", b"x" * 11)  # larger than the bound on its own: not kept
    assert "huge" not in lru


def test_entry_bytes_round_trip() -> None:
    entry = GrammarEntry(
        kind="regex", source="a+", tokenizer_id="t", artifact=b"\x00\x01", artifact_format="f"
    )
    assert GrammarEntry.from_bytes(entry.to_bytes()) == entry
    with pytest.raises(msgspec.DecodeError):
        GrammarEntry.from_bytes(b"\xff garbage")


# -- the registry -----------------------------------------------------------------------------


def _request(
    source: str, kind: str = "regex", tokenizer_id: str = TOKENIZER_ID
) -> GrammarCompileRequest:
    return GrammarCompileRequest(rid="r", kind=kind, source=source, tokenizer_id=tokenizer_id)  # type: ignore[arg-type]


class CountingBuild:
    """The real compile + serialize, counted, optionally slowed down."""

    def __init__(self, compiler: XGrammarCompiler, delay_s: float = 0.0) -> None:
        self.build = entry_builder(compiler, TOKENIZER_ID)
        self.delay_s = delay_s
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, source: GrammarSource) -> GrammarEntry:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return self.build(source)


async def test_registry_compiles_once_and_answers_from_memory(compiler: XGrammarCompiler) -> None:
    build = CountingBuild(compiler, delay_s=0.2)
    registry = GrammarRegistry(build=build, tokenizer_id=TOKENIZER_ID)
    replies = await asyncio.gather(*(registry.compile(_request("[xy]{4}")) for _ in range(5)))
    assert build.calls == 1 and all(r.ok for r in replies)
    assert sorted(r.cached for r in replies) == [False, True, True, True, True]
    assert registry.counters.joined == 4
    again = await registry.compile(_request("[xy]{4}"))
    assert again.cached and registry.counters.memory_hits == 1
    fetched = await registry.fetch(GrammarFetchRequest(rid="f", key=again.key))
    assert fetched.ok and fetched.compiled is not None and fetched.source == "[xy]{4}"
    await registry.close()


async def test_registry_refusals(compiler: XGrammarCompiler) -> None:
    build = CountingBuild(compiler)
    registry = GrammarRegistry(
        build=build, tokenizer_id=TOKENIZER_ID, settings=RegistrySettings(max_reply_bytes=1000)
    )
    invalid = await registry.compile(_request("[a-"))
    assert (invalid.ok, invalid.code, invalid.cached) == (False, "invalid_grammar", False)
    assert (await registry.compile(_request("[a-"))).code == "invalid_grammar"
    assert build.calls == 1  # the refusal is remembered too
    other = await registry.compile(_request("a", tokenizer_id="tok-other"))
    assert (other.ok, other.code) == (False, "grammar_unavailable")
    unknown = await registry.fetch(GrammarFetchRequest(rid="f", key="regex:" + "0" * 32))
    assert (unknown.ok, unknown.code) == (False, "unknown_key")
    # An artifact too large for one message: the reply carries the source only.
    ok = await registry.compile(_request("[a-z]{1,40}"))
    fetched = await registry.fetch(GrammarFetchRequest(rid="f", key=ok.key))
    assert fetched.ok and fetched.compiled is None and fetched.source == "[a-z]{1,40}"
    await registry.close()


async def test_a_slow_compile_is_retried_later_and_then_cached(compiler: XGrammarCompiler) -> None:
    build = CountingBuild(compiler, delay_s=0.5)
    registry = GrammarRegistry(
        build=build, tokenizer_id=TOKENIZER_ID, settings=RegistrySettings(compile_timeout_s=0.1)
    )
    late = await registry.compile(_request("[pq]{3}"))
    assert (late.ok, late.code) == (False, "grammar_unavailable")
    assert "retry" in (late.error or "")
    await asyncio.sleep(0.8)  # the compile went on in its thread
    retried = await registry.compile(_request("[pq]{3}"))
    assert (retried.ok, retried.cached) == (True, True) and build.calls == 1
    await registry.close()


# -- the worker's loader -----------------------------------------------------------------------


def _tokenized(key: str | None, regex: str | None = "[0-9]{2}") -> TokenizedRequest:
    return TokenizedRequest(
        rid="r1",
        gateway_id="gw",
        input_ids=pack_tokens([1, 2, 3]),
        sampling=SamplingParams(regex=regex),
        grammar_key=key,
    )


async def test_loader_uses_the_artifact_else_compiles_the_source(
    compiler: XGrammarCompiler, tokenizer: Any
) -> None:
    from radixserve.engine.constrained import GrammarBackend
    from radixserve.worker.grammars import GrammarLoader, GrammarLoadError

    registry = GrammarRegistry(
        build=entry_builder(compiler, TOKENIZER_ID), tokenizer_id=TOKENIZER_ID
    )
    key = (await registry.compile(_request("[0-9]{2}"))).key
    fetches: list[str] = []

    async def fetch(req: GrammarFetchRequest) -> GrammarFetchReply | None:
        fetches.append(req.key)
        return await registry.fetch(req)

    same_vocab = GrammarLoader(GrammarBackend(tokenizer, len(tokenizer)), fetch)
    grammars = await asyncio.gather(*(same_vocab.load(_tokenized(key)) for _ in range(4)))
    assert len(fetches) == 1 and all(g is grammars[0] for g in grammars)
    assert (same_vocab.loaded_artifacts, same_vocab.compiled_sources) == (1, 0)
    # A worker with a padded vocabulary cannot read the artifact: it compiles the source.
    padded = GrammarLoader(GrammarBackend(tokenizer, len(tokenizer) + 64), fetch)
    await padded.load(_tokenized(key))
    assert (padded.loaded_artifacts, padded.compiled_sources) == (0, 1)

    async def silent(req: GrammarFetchRequest) -> GrammarFetchReply | None:
        return None  # no grammar service: the request's own source is compiled

    alone = GrammarLoader(GrammarBackend(tokenizer, len(tokenizer)), silent)
    await alone.load(_tokenized("regex:unknown"))
    assert alone.compiled_sources == 1
    with pytest.raises(GrammarLoadError) as info:
        await alone.load(_tokenized("regex:bad", regex="[0-"))
    error = info.value.to_request_error(_tokenized("regex:bad", regex="[0-"))
    assert (error.http_status, error.code, error.param) == (400, "invalid_grammar", "regex")
    await registry.close()


async def test_loads_of_one_key_share_one_compile_even_past_its_timeout(tokenizer: Any) -> None:
    from radixserve.engine.constrained import GrammarBackend
    from radixserve.worker.grammars import GrammarLoader, GrammarLoadError

    class CountingBackend(GrammarBackend):
        compiles = 0

        def compile_keyed(self, key: str, source: Any) -> Any:
            CountingBackend.compiles += 1
            return super().compile_keyed(key, source)

    async def silent(req: GrammarFetchRequest) -> GrammarFetchReply | None:
        return None  # no grammar service: the source is compiled here

    # A schema that takes about a second to compile, against a 50 ms timeout.
    schema = '{"type": "object", "properties": {"s": {"type": "string", "maxLength": 2048}}}'
    request = TokenizedRequest(
        rid="slow",
        gateway_id="gw",
        input_ids=pack_tokens([1, 2, 3]),
        sampling=SamplingParams(json_schema=schema),
        grammar_key="json_schema:slow",
    )
    loader = GrammarLoader(
        CountingBackend(tokenizer, len(tokenizer)), silent, compile_timeout_s=0.05
    )
    outcomes = await asyncio.gather(
        *(loader.load(request) for _ in range(4)), return_exceptions=True
    )
    assert all(isinstance(o, GrammarLoadError) and o.http_status == 503 for o in outcomes)
    assert CountingBackend.compiles == 1  # the waiters did not start compiles of their own
    # The compile went on past the timeout and cached its grammar for the next request.
    deadline = asyncio.get_running_loop().time() + 30
    while loader.backend.cached("json_schema:slow") is None:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    assert await loader.load(request) is loader.backend.cached("json_schema:slow")
    assert CountingBackend.compiles == 1


# -- protocol, prep and the API mapping ---------------------------------------------------------


def test_wire_additions_round_trip_and_old_replies_still_decode() -> None:
    reply = GrammarCompileReply(
        rid="r", key="k", ok=False, error="e", code="invalid_grammar", cached=True
    )
    assert decode(encode(reply), GrammarCompileReply) == reply
    old = msgspec.msgpack.encode({"rid": "r", "key": "k", "ok": True})
    assert decode(old, GrammarCompileReply).code is None
    params = SamplingParams(structural_tag='{"structures": []}')
    assert decode(encode(params), SamplingParams).structural_tag == '{"structures": []}'
    assert grammar_key("structural_tag", "x", "t").startswith("structural_tag:")


def test_prep_maps_reply_codes_to_http_errors() -> None:
    from radixserve.prep import PrepError, grammar_spec, key_from_reply

    spec = grammar_spec(SamplingParams(json_schema="{}"))
    assert spec is not None
    for code, status, expected in (
        ("invalid_grammar", 400, "invalid_grammar"),
        ("grammar_unavailable", 503, "grammar_unavailable"),
        (None, 400, "grammar_not_supported"),
    ):
        reply = GrammarCompileReply(rid="r", key="", ok=False, error="why", code=code)
        with pytest.raises(PrepError) as info:
            key_from_reply(reply, spec)
        assert (info.value.http_status, info.value.code, info.value.param) == (
            status,
            expected,
            "json_schema",
        )
    tag = grammar_spec(SamplingParams(structural_tag="{}"))
    assert tag is not None and tag.kind == "structural_tag"


def test_response_formats_map_to_grammar_fields() -> None:
    from radixserve.api.mapping import plan_chat
    from radixserve.api.openai_models import ChatCompletionRequest

    def sampling(response_format: dict[str, Any]) -> SamplingParams:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
        )
        plan = plan_chat(body, response_id="r", gateway_id="g", served_model="m", arrival_time=0.0)
        return plan.submits[0].sampling

    assert sampling({"type": "json_object"}).json_schema == '{"type": "object"}'
    schema = {"type": "integer"}
    strict = sampling(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    )
    assert json.loads(strict.json_schema or "") == schema
    structures = [{"begin": "<f>", "schema": schema, "end": "</f>"}]
    tagged = sampling({"type": "structural_tag", "structures": structures, "triggers": ["<f>"]})
    assert json.loads(tagged.structural_tag or "") == {
        "structures": structures,
        "triggers": ["<f>"],
    }
    assert tagged.json_schema is None
