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
    FinishReason,
    GrammarCompileRequest,
    Heartbeat,
    KvEventBatch,
    Message,
    ProtocolError,
    RemovedBlocks,
    RoutedRequest,
    SamplingParams,
    StepOutput,
    StepOutputBatch,
    StoredBlocks,
    SubmitRequest,
    TextDelta,
    TokenizedRequest,
    TopLogprobs,
    WorkerStatus,
    block_hashes,
    convert,
    decode,
    encode,
    grammar_key,
    pack_tokens,
    unpack_tokens,
    unpack_tokens_array,
)
from tests.unit.protocol_samples import (
    CAPACITY,
    HEARTBEAT,
    INT32_MAX,
    INT32_MIN,
    ROUTED,
    SAMPLES,
    STEP_FULL,
    UNICODE,
)


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
