"""The wire contract: every message round-trips, token ids are int32, subjects and wildcards agree."""

from __future__ import annotations

import inspect
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import radixserve.protocol as proto
from radixserve.protocol import (
    AbortRequest,
    AllBlocksCleared,
    ChatMessage,
    DetokParams,
    FinishReason,
    FlushCacheReply,
    FlushCacheRequest,
    GrammarCompileReply,
    GrammarCompileRequest,
    GrammarFetchReply,
    GrammarFetchRequest,
    Heartbeat,
    KvEventBatch,
    KvSnapshotRequest,
    LogprobEntry,
    Message,
    ProtocolError,
    RemovedBlocks,
    RequestError,
    RoutedRequest,
    SamplingParams,
    StepOutput,
    StepOutputBatch,
    StoredBlocks,
    Subjects,
    SubmitRequest,
    TextDelta,
    TextDeltaBatch,
    TokenizedRequest,
    TopLogprobEntry,
    TopLogprobs,
    WorkerCapacity,
    WorkerStats,
    WorkerStatus,
    block_hashes,
    convert,
    decode,
    encode,
    grammar_key,
    pack_tokens,
    subject_matches,
    unpack_tokens,
    unpack_tokens_array,
)

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
UNICODE = "héllo wörld — 你好 🦀👩‍👩‍👧 e\u0301 \u200b\U0010fffd"

# -- one or more instances of every message type ----------------------------------------

FULL_SAMPLING = SamplingParams(
    max_new_tokens=7,
    temperature=0.25,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    repetition_penalty=1.1,
    stop=["\n\n", UNICODE],
    stop_token_ids=[2, INT32_MAX],
    ignore_eos=True,
    min_new_tokens=3,
    n=2,
    seed=1234,
    skip_special_tokens=False,
    return_logprob=True,
    top_logprobs_num=5,
    regex=r"\d+",
    json_schema='{"type": "object"}',
    ebnf='root ::= "a"',
)
TOKENIZED = TokenizedRequest(
    rid="r-1",
    gateway_id="gw-0",
    input_ids=pack_tokens([1, 0, INT32_MAX, 17]),
    sampling=FULL_SAMPLING,
    grammar_key="regex:abc",
    stream=True,
    priority=3,
    arrival_time=1.7e9,
    model="smollm2",
)
FINISH_STOP = FinishReason(kind="stop", matched="###")
ROUTED = RoutedRequest(
    request=TOKENIZED, worker_id="w-3", expected_cached_tokens=2, routed_at=2.5, attempt=1
)
STEP_FULL = StepOutput(
    rid="r-7",
    gateway_id="g",
    new_token_ids=pack_tokens([INT32_MAX, 9]),
    index=1,
    finish_reason=FINISH_STOP,
    prompt_tokens=10,
    completion_tokens=4,
    cached_tokens=8,
    token_logprobs=[-0.5, float("-inf")],
    top_logprobs=[
        TopLogprobs(token_ids=pack_tokens([1]), logprobs=[-0.5]),
        TopLogprobs(token_ids=b"", logprobs=[]),
    ],
    detok=DetokParams(stop=["x"]),
)
CAPACITY = WorkerCapacity(
    max_running_requests=64,
    max_total_num_tokens=200_000,
    max_context_len=8192,
    page_size=16,
    kv_block_size=16,
)
HEARTBEAT = Heartbeat(
    worker_id="w-0", time=1.0, status=WorkerStatus.STARTING, capacity=CAPACITY, epoch=5
)

SAMPLES: list[Message] = [
    SamplingParams(),
    FULL_SAMPLING,
    ChatMessage(role="user", content=UNICODE),
    ChatMessage(role="tool", content="", name="calc"),
    SubmitRequest(rid="r-1", gateway_id="gw-0", text=UNICODE),
    SubmitRequest(rid="r-2", gateway_id="gw-0", input_ids=b""),
    SubmitRequest(
        rid="r-3",
        gateway_id="gw-1",
        input_ids=pack_tokens([INT32_MAX, 0, 5]),
        sampling=FULL_SAMPLING,
        stream=True,
        priority=-2,
        arrival_time=1.5,
        model="m",
    ),
    SubmitRequest(
        rid="r-4",
        gateway_id="gw-1",
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="hi"),
        ],
    ),
    TOKENIZED,
    TokenizedRequest(rid="r-5", gateway_id="g", input_ids=b""),
    ROUTED,
    FinishReason(kind="length"),
    FINISH_STOP,
    FinishReason(kind="stop", matched=INT32_MAX),
    FinishReason(kind="abort", message="client disconnected"),
    TopLogprobs(token_ids=pack_tokens([3, 4]), logprobs=[-0.1, -2.5]),
    DetokParams(skip_special_tokens=False, stop=["</s>"]),
    StepOutput(rid="r-6", gateway_id="g"),
    STEP_FULL,
    StepOutputBatch(worker_id="w-0", step=0),
    StepOutputBatch(
        worker_id="w-0",
        step=99,
        outputs=[
            StepOutput(rid=f"r-{i}", gateway_id=f"g{i % 2}", new_token_ids=pack_tokens([i]))
            for i in range(3)
        ],
    ),
    TopLogprobEntry(token_id=5, token=" the", logprob=-0.01),
    LogprobEntry(token_id=INT32_MAX, token=UNICODE, logprob=-1.0),
    LogprobEntry(
        token_id=1,
        token="a",
        logprob=-1.0,
        top=[TopLogprobEntry(token_id=2, token="b", logprob=-3.0)],
    ),
    TextDelta(rid="r-8"),
    TextDelta(
        rid="r-9",
        text=UNICODE,
        token_ids=pack_tokens([1, 2, 3]),
        index=1,
        finish_reason=FinishReason(kind="length"),
        prompt_tokens=3,
        completion_tokens=3,
        cached_tokens=1,
        logprobs=[LogprobEntry(token_id=1, token="x", logprob=-0.2)],
    ),
    TextDeltaBatch(gateway_id="g"),
    TextDeltaBatch(gateway_id="g", deltas=[TextDelta(rid="a", text="x"), TextDelta(rid="b")]),
    AbortRequest(rid="r-10"),
    AbortRequest(rid="r-11", reason="client disconnected"),
    RequestError(rid="r-12", code="context_length_exceeded", message=UNICODE, http_status=400),
    RequestError(
        rid="r-13",
        code="rate_limited",
        message="slow down",
        http_status=429,
        error_type="rate_limit_error",
        param="model",
        service="scheduler",
    ),
    FlushCacheRequest(rid="f-1"),
    FlushCacheReply(rid="f-1", ok=True),
    FlushCacheReply(rid="f-1", ok=False, worker_id="w-1", message="busy"),
    StoredBlocks(block_hashes=[], token_ids=b"", block_size=4),
    StoredBlocks(
        block_hashes=block_hashes([1, 2, 3, 4], 2),
        token_ids=pack_tokens([1, 2, 3, 4]),
        block_size=2,
        parent_hash=-(2**63),
    ),
    RemovedBlocks(block_hashes=[2**63 - 1, -(2**63), 0]),
    AllBlocksCleared(),
    KvEventBatch(worker_id="w-0", epoch=0, seq=0),
    KvEventBatch(
        worker_id="w-0",
        epoch=1_700_000_000_000_000_000,
        seq=41,
        time=3.0,
        events=[
            AllBlocksCleared(),
            StoredBlocks(block_hashes=[7], token_ids=pack_tokens([INT32_MAX]), block_size=1),
            RemovedBlocks(block_hashes=[7]),
        ],
    ),
    KvSnapshotRequest(worker_id="w-0"),
    KvSnapshotRequest(worker_id="w-0", reason="seq gap"),
    CAPACITY,
    WorkerCapacity(max_running_requests=1, max_total_num_tokens=0, max_context_len=1),
    HEARTBEAT,
    Heartbeat(
        worker_id="w-0",
        time=1.0,
        status=WorkerStatus.DRAINING,
        capacity=CAPACITY,
        epoch=5,
        kv_event_seq=12,
        model="m",
        tokenizer_id="tok",
    ),
    WorkerStats(worker_id="w-1", time=2.0, num_running_reqs=0, num_queue_reqs=0, free_kv_tokens=0),
    WorkerStats(
        worker_id="w-1",
        time=2.0,
        num_running_reqs=12,
        num_queue_reqs=3,
        free_kv_tokens=1000,
        evictable_kv_tokens=500,
        total_kv_tokens=4096,
        token_usage=0.75,
        cache_hit_rate=0.5,
        gen_throughput=123.4,
    ),
    GrammarCompileRequest(rid="r-14", kind="json_schema", source=UNICODE, tokenizer_id="tok"),
    GrammarCompileReply(rid="r-14", key="json_schema:abc", ok=True),
    GrammarCompileReply(rid="r-14", key="", ok=False, error="bad schema"),
    GrammarFetchRequest(rid="r-15", key="ebnf:abc"),
    GrammarFetchReply(rid="r-15", key="ebnf:abc", ok=False, error="unknown key"),
    GrammarFetchReply(
        rid="r-15",
        key="ebnf:abc",
        ok=True,
        kind="ebnf",
        source='root ::= "a"',
        tokenizer_id="tok",
        compiled=b"\x00\xff" * 10,
    ),
]


def _message_types() -> set[type]:
    return {
        obj
        for name in proto.__all__
        if inspect.isclass(obj := getattr(proto, name))
        and issubclass(obj, Message)
        and obj is not Message
    }


def test_every_message_type_has_a_sample() -> None:
    missing = _message_types() - {type(m) for m in SAMPLES}
    assert not missing, f"add samples for {sorted(t.__name__ for t in missing)}"


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data, type(msg))
    assert back == msg
    assert type(back) is type(msg)
    # The decoder accepts any buffer the NATS client may hand over.
    assert decode(bytearray(data), type(msg)) == msg
    assert decode(memoryview(data), type(msg)) == msg


def test_round_trip_keeps_token_ids_and_text() -> None:
    out = decode(encode(HEARTBEAT), Heartbeat)
    assert out.status is WorkerStatus.STARTING and out.capacity == CAPACITY
    step = decode(
        encode(StepOutputBatch(worker_id="w", step=1, outputs=[STEP_FULL])), StepOutputBatch
    )
    item = step.outputs[0]
    assert item.new_token_ids_list == [INT32_MAX, 9]
    assert item.top_logprobs is not None and item.top_logprobs[0].token_ids_list == [1]
    assert item.token_logprobs == [-0.5, float("-inf")]
    routed = decode(encode(ROUTED), RoutedRequest)
    assert routed.rid == "r-1" and routed.request.input_ids_list == [1, 0, INT32_MAX, 17]
    assert routed.request.prompt_tokens == 4
    delta = decode(encode(TextDelta(rid="r", text=UNICODE)), TextDelta)
    assert delta.text == UNICODE and delta.token_ids_list == []


def test_optional_fields_left_out_come_back_as_defaults() -> None:
    msg = StepOutput(rid="r", gateway_id="g")
    back = decode(encode(msg), StepOutput)
    assert back.finish_reason is None and back.token_logprobs is None and back.detok is None
    assert back.new_token_ids == b""
    # omit_defaults: nothing but the required fields is on the wire.
    assert msgspec.msgpack.decode(encode(msg)) == {"rid": "r", "gateway_id": "g"}


@given(st.text(), st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=50))
def test_text_delta_round_trip_any_unicode(text: str, ids: list[int]) -> None:
    msg = TextDelta(rid=text, text=text, token_ids=pack_tokens(ids))
    back = decode(encode(msg), TextDelta)
    assert back == msg and back.text == text and back.token_ids_list == ids


def test_unknown_fields_are_ignored_for_rolling_upgrades() -> None:
    data = msgspec.msgpack.encode({"rid": "r", "reason": "x", "added_in_v2": [1, 2]})
    assert decode(data, AbortRequest) == AbortRequest(rid="r", reason="x")


def test_messages_are_frozen() -> None:
    msg = AbortRequest(rid="r")
    with pytest.raises(AttributeError):
        msg.rid = "other"  # type: ignore[misc]


# -- token packing ---------------------------------------------------------------------


@given(st.lists(st.integers(INT32_MIN, INT32_MAX)))
def test_pack_round_trip_and_is_int32_le(ids: list[int]) -> None:
    packed = pack_tokens(ids)
    assert len(packed) == 4 * len(ids)
    assert packed == struct.pack(f"<{len(ids)}i", *ids)  # reference: the stdlib's int32 LE
    assert unpack_tokens(packed) == ids
    assert pack_tokens(np.asarray(ids, dtype=np.int64)) == packed
    assert unpack_tokens_array(packed).dtype == np.dtype("<i4")


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, ">i4"]
)
def test_pack_accepts_integer_arrays_of_any_width(dtype: str) -> None:
    arr = np.array([0, 1, 100, 127], dtype=dtype)
    assert pack_tokens(arr) == struct.pack("<4i", 0, 1, 100, 127)


def test_pack_empty_inputs() -> None:
    assert pack_tokens([]) == b""
    assert pack_tokens(np.array([], dtype=np.int64)) == b""
    assert pack_tokens(np.array([], dtype=np.float32)) == b""
    assert unpack_tokens(b"") == []


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([INT32_MAX + 1], "outside the int32 range"),
        ([INT32_MIN - 1], "outside the int32 range"),
        (np.array([2**40], dtype=np.int64), "outside the int32 range"),
        (np.array([2**32 - 1], dtype=np.uint32), "outside the int32 range"),
        ([2**70], "must be int32 integers"),
        ([1.5, 2.0], "must be int32 integers"),
        (np.array([1.0]), "must be int32 integers"),
        ([True, False], "must be int32 integers"),
        (np.zeros((2, 2), dtype=np.int32), "one-dimensional"),
    ],
)
def test_pack_rejects_what_would_not_survive(tokens: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        pack_tokens(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_unpack_rejects_a_length_not_multiple_of_4(size: int) -> None:
    with pytest.raises(ProtocolError, match="multiple of 4"):
        unpack_tokens(b"\x01" * size)


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


# -- malformed input ----------------------------------------------------------------------


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("data", "type_"),
    [
        (b"", AbortRequest),
        (b"\xc1", AbortRequest),  # 0xc1 is never used in msgpack
        (encode(ROUTED)[:-3], RoutedRequest),  # truncated
        (b"not msgpack at all", SubmitRequest),
        (_raw([1, 2, 3]), AbortRequest),  # an array where a map is expected
        (_raw({"reason": "x"}), AbortRequest),  # required rid missing
        (_raw({"rid": 5}), AbortRequest),  # int for str
        (
            _raw({"rid": "r", "gateway_id": "g", "text": "x", "sampling": {"temperature": "hot"}}),
            SubmitRequest,
        ),
        (
            _raw({"rid": "r", "gateway_id": "g", "text": "x", "sampling": {"max_new_tokens": 1.5}}),
            SubmitRequest,
        ),
        (
            _raw({"rid": "r", "gateway_id": "g", "text": "x", "sampling": {"stop": "single"}}),
            SubmitRequest,
        ),
        (
            _raw({"rid": "r", "gateway_id": "g", "input_ids": [1, 2]}),
            SubmitRequest,
        ),  # list, not bytes
        (_raw({"rid": "r", "gateway_id": "g", "input_ids": b"\x00" * 5}), SubmitRequest),
        (_raw({"rid": "r", "gateway_id": "g", "text": "x", "input_ids": b""}), SubmitRequest),
        (_raw({"rid": "r", "gateway_id": "g"}), SubmitRequest),  # no input at all
        (
            _raw({"rid": "r", "gateway_id": "a.b", "text": "x"}),
            SubmitRequest,
        ),  # id splits a subject
        (_raw({"rid": "r", "gateway_id": "g", "new_token_ids": b"\x00\x00"}), StepOutput),
        (
            _raw({"rid": "r", "gateway_id": "g", "new_token_ids": b"", "token_logprobs": [-1.0]}),
            StepOutput,
        ),
        (_raw({"kind": "timeout"}), FinishReason),
        (
            _raw({"worker_id": "w", "epoch": 0, "seq": 0, "events": [{"type": "moved"}]}),
            KvEventBatch,
        ),
        (
            _raw(
                {
                    "worker_id": "w",
                    "epoch": 0,
                    "seq": 0,
                    "events": [
                        {
                            "type": "stored",
                            "block_hashes": [1, 2],
                            "token_ids": b"\x00" * 4,
                            "block_size": 1,
                        }
                    ],
                }
            ),
            KvEventBatch,
        ),
        (_raw({"block_hashes": [1], "token_ids": b"\x00" * 4, "block_size": 0}), StoredBlocks),
        (_raw({"block_hashes": ["7"]}), RemovedBlocks),
        (encode(HEARTBEAT).replace(b"starting", b"sleeping"), Heartbeat),
        (
            _raw({"rid": "r", "kind": "yaml", "source": "", "tokenizer_id": "t"}),
            GrammarCompileRequest,
        ),
        (encode(AbortRequest(rid="r")), Heartbeat),  # another message's bytes
    ],
)
def test_malformed_bytes_raise_protocol_error(data: bytes, type_: type) -> None:
    with pytest.raises(ProtocolError, match=f"cannot decode {type_.__name__}"):
        decode(data, type_)


def test_mistyped_field_fails_at_decode_with_the_field_path() -> None:
    bad = StepOutputBatch(worker_id="w", step=1, outputs=[StepOutput(rid="r", gateway_id="g")])
    data = encode(msgspec.structs.replace(bad, step="one"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"\$\.step"):
        decode(data, StepOutputBatch)


def test_construction_checks_the_same_invariants() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        SubmitRequest(rid="r", gateway_id="g", text="a", messages=[])
    with pytest.raises(ValueError, match="multiple of 4"):
        TokenizedRequest(rid="r", gateway_id="g", input_ids=b"\x00")
    with pytest.raises(ValueError, match="token_logprobs has 2 entries for 1"):
        StepOutput(
            rid="r", gateway_id="g", new_token_ids=pack_tokens([1]), token_logprobs=[0.0, 0.0]
        )
    with pytest.raises(ValueError, match="differ in length"):
        TopLogprobs(token_ids=pack_tokens([1, 2]), logprobs=[0.0])


def test_encode_unencodable_value_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="cannot encode AbortRequest"):
        encode(AbortRequest(rid=object()))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot encode RemovedBlocks"):
        encode(RemovedBlocks(block_hashes=[2**64]))  # msgpack ints stop at 64 bits


def test_convert_json_body_is_strict() -> None:
    body = {"max_new_tokens": 8, "temperature": 0, "stop": ["a"], "json_schema": "{}"}
    params = convert(body, SamplingParams)
    assert params == SamplingParams(max_new_tokens=8, temperature=0.0, stop=["a"], json_schema="{}")
    assert isinstance(params.temperature, float)
    with pytest.raises(ProtocolError, match=r"invalid SamplingParams.*\$\.temperature"):
        convert({"temperature": "0.7"}, SamplingParams)
    with pytest.raises(ProtocolError, match=r"\$\.seed"):
        convert({"seed": 1.5}, SamplingParams)


def test_out_of_range_sampling_values_pass_through_for_the_engine() -> None:
    odd = SamplingParams(temperature=-1.0, top_p=7.0, top_k=-5, n=0, max_new_tokens=-1)
    assert decode(encode(odd), SamplingParams) == odd


# -- KV block hashes and grammar keys -----------------------------------------------------


def test_block_hashes_chain_and_prefix_property() -> None:
    ids = list(range(100, 110))
    full = block_hashes(ids, 4)
    assert len(full) == 2  # 10 ids -> 2 whole blocks, the tail of 2 is not hashed
    assert block_hashes(ids[:8], 4) == full
    assert block_hashes(ids[:4], 4) == full[:1]
    assert block_hashes(ids[4:8], 4, parent_hash=full[0]) == full[1:]
    assert block_hashes(ids[4:8], 4) != full[1:]  # the parent is part of the name
    assert block_hashes([100, 101, 102, 999], 4) != full[:1]
    assert block_hashes(np.asarray(ids, dtype=np.int64), 4) == full
    assert all(-(2**63) <= h < 2**63 for h in full)
    assert block_hashes(ids[:3], 4) == []
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(ids, 0)


def test_block_hashes_are_pinned() -> None:
    # The value crosses processes and releases (worker vs scheduler): it must not drift.
    assert block_hashes([1, 2, 3, 4], 2) == [-1871280535689632213, 4846721673529240091]


def test_grammar_key_is_stable_and_separates_its_parts() -> None:
    key = grammar_key("regex", r"\d+", "tok")
    assert key == grammar_key("regex", r"\d+", "tok")
    assert key.startswith("regex:") and len(key) == len("regex:") + 32
    assert key != grammar_key("ebnf", r"\d+", "tok")
    assert key != grammar_key("regex", r"\d+", "tok2")
    assert grammar_key("regex", "ab", "c") != grammar_key("regex", "a", "bc")


# -- subjects ----------------------------------------------------------------------------


def _concrete(s: Subjects, worker: str = "w-0", gateway: str = "gw-0") -> dict[str, str]:
    return {
        "tokenize": s.tokenize,
        "schedule": s.schedule,
        "worker_run": s.worker_run(worker),
        "worker_abort": s.worker_abort(worker),
        "worker_flush_cache": s.worker_flush_cache(worker),
        "worker_kv_snapshot": s.worker_kv_snapshot(worker),
        "abort": s.abort,
        "flush_cache": s.flush_cache,
        "detok": s.detok,
        "gateway_deltas": s.gateway_deltas(gateway),
        "gateway_errors": s.gateway_errors(gateway),
        "grammar_compile": s.grammar_compile,
        "grammar_fetch": s.grammar_fetch,
        "kv_events": s.kv_events(worker),
        "stats": s.stats(worker),
        "heartbeat": s.heartbeat(worker),
    }


def test_default_subjects() -> None:
    s = Subjects()
    assert _concrete(s) == {
        "tokenize": "radixserve.tokenize",
        "schedule": "radixserve.schedule",
        "worker_run": "radixserve.worker.w-0.run",
        "worker_abort": "radixserve.worker.w-0.abort",
        "worker_flush_cache": "radixserve.worker.w-0.flush_cache",
        "worker_kv_snapshot": "radixserve.worker.w-0.kv_snapshot",
        "abort": "radixserve.abort",
        "flush_cache": "radixserve.flush_cache",
        "detok": "radixserve.detok",
        "gateway_deltas": "radixserve.gateway.gw-0.deltas",
        "gateway_errors": "radixserve.gateway.gw-0.errors",
        "grammar_compile": "radixserve.grammar.compile",
        "grammar_fetch": "radixserve.grammar.fetch",
        "kv_events": "radixserve.kv_events.w-0",
        "stats": "radixserve.stats.w-0",
        "heartbeat": "radixserve.heartbeat.w-0",
    }


@pytest.mark.parametrize("prefix", ["radixserve", "rs", "prod.eu.rs"])
def test_subjects_are_built_from_the_prefix(prefix: str) -> None:
    s = Subjects(prefix)
    subjects = _concrete(s)
    assert len(set(subjects.values())) == len(subjects)  # no two kinds share a subject
    for subject in subjects.values():
        assert subject.startswith(prefix + ".")
        assert subject_matches(s.everything, subject)
        assert not subject_matches(Subjects("other").everything, subject)


# Which wildcard must match which concrete subject kind; every other pair must not match.
WILDCARDS = {
    "worker_run_all": {"worker_run"},
    "worker_abort_all": {"worker_abort"},
    "gateway_deltas_all": {"gateway_deltas"},
    "gateway_errors_all": {"gateway_errors"},
    "kv_events_all": {"kv_events"},
    "stats_all": {"stats"},
    "heartbeat_all": {"heartbeat"},
}


@pytest.mark.parametrize("prefix", ["radixserve", "prod.eu.rs"])
@pytest.mark.parametrize("ids", [("w-0", "gw-0"), ("worker_7", "7f3a")])
def test_wildcards_match_exactly_their_concrete_subjects(prefix: str, ids: tuple[str, str]) -> None:
    s = Subjects(prefix)
    concrete = _concrete(s, *ids)
    for wildcard_name, kinds in WILDCARDS.items():
        pattern = getattr(s, wildcard_name)
        matched = {kind for kind, subject in concrete.items() if subject_matches(pattern, subject)}
        assert matched == kinds, wildcard_name
    worker_kinds = {k for k, v in concrete.items() if subject_matches(s.worker_all(ids[0]), v)}
    assert worker_kinds == {
        "worker_run",
        "worker_abort",
        "worker_flush_cache",
        "worker_kv_snapshot",
    }
    assert not subject_matches(s.worker_all("someone-else"), s.worker_run(ids[0]))
    gateway_kinds = {k for k, v in concrete.items() if subject_matches(s.gateway_all(ids[1]), v)}
    assert gateway_kinds == {"gateway_deltas", "gateway_errors"}


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.d", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        (">", "a", True),
        ("*", "a.b", False),
        ("*.>", "a.b", True),
    ],
)
def test_subject_matcher_follows_nats_rules(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


def test_matcher_rejects_gt_in_the_middle() -> None:
    with pytest.raises(ValueError, match="last token"):
        subject_matches("a.>.b", "a.x.b")


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "has space", "tab\t", "new\nline"])
def test_ids_that_would_break_a_subject_are_rejected(bad: str) -> None:
    s = Subjects()
    for make in (s.worker_run, s.worker_abort, s.kv_events, s.stats, s.heartbeat, s.gateway_deltas):
        with pytest.raises(ValueError, match="invalid"):
            make(bad)


@pytest.mark.parametrize("bad", ["", ".rs", "rs.", "a..b", "a.*", "a.>", "a b"])
def test_bad_prefix_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Subjects(bad)


def test_id_from_subject() -> None:
    s = Subjects("prod.rs")
    assert s.id_from(s.kv_events("w-9")) == "w-9"
    assert s.id_from(s.heartbeat("w-9")) == "w-9"
    assert s.id_from(s.worker_run("w-9")) == "w-9"
    assert s.id_from(s.gateway_deltas("gw")) == "gw"
    with pytest.raises(ValueError):
        s.id_from(s.tokenize)
    with pytest.raises(ValueError):
        s.id_from(Subjects("other").kv_events("w-9"))


def test_queue_groups_are_distinct_tokens() -> None:
    groups = [proto.QueueGroups.TOKENIZER, proto.QueueGroups.SCHEDULER, proto.QueueGroups.GRAMMAR]
    assert len(set(groups)) == len(groups)
    for group in groups:
        proto.check_token(group)
