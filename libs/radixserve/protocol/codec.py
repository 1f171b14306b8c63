"""encode / decode for every protocol message: msgpack via msgspec, decoders cached per type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from radixserve.protocol.errors import ProtocolError

T = TypeVar("T")

# One encoder serves every type: a msgspec Encoder carries no per-type state.
# Decoders are per type because the type is what they validate against.
_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decoder_for(type_: type[T]) -> msgspec.msgpack.Decoder[T]:
    """The cached decoder for `type_` (built on first use; reuse is what makes decode cheap)."""
    decoder = _DECODERS.get(type_)
    if decoder is None:
        try:
            decoder = msgspec.msgpack.Decoder(type_)
        except TypeError as exc:
            raise ProtocolError(f"{type_!r} is not a type the protocol can decode: {exc}") from exc
        _DECODERS[type_] = decoder
    return decoder


def encode(msg: msgspec.Struct) -> bytes:
    """A message -> msgpack bytes.

    Field types are not checked on the way out (msgspec checks on decode), so a
    wrong type a sender put in a field fails at the receiver with ProtocolError.
    """
    try:
        return _ENCODER.encode(msg)
    except (msgspec.EncodeError, TypeError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, type_: type[T]) -> T:
    """msgpack bytes -> a `type_` message; ProtocolError if malformed or mistyped."""
    try:
        return decoder_for(type_).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = getattr(type_, "__name__", repr(type_))
        raise ProtocolError(f"cannot decode {name}: {exc}") from exc


def encode_json(msg: msgspec.Struct) -> str:
    """A message -> JSON text (bytes fields as base64), for stores that keep text."""
    try:
        return _JSON_ENCODER.encode(msg).decode()
    except (msgspec.EncodeError, TypeError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from exc


def decode_json(data: str | bytes, type_: type[T]) -> T:
    """JSON text from `encode_json` -> a `type_` message; ProtocolError if malformed."""
    try:
        return msgspec.json.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = getattr(type_, "__name__", repr(type_))
        raise ProtocolError(f"cannot decode {name}: {exc}") from exc


def convert(obj: Mapping[str, Any], type_: type[T]) -> T:
    """A decoded JSON object (e.g. an HTTP body's `sampling_params`) -> a `type_` message.

    Same strict typing as `decode`: "0.7" for a float field is a ProtocolError.
    """
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        name = getattr(type_, "__name__", repr(type_))
        raise ProtocolError(f"invalid {name}: {exc}") from exc
