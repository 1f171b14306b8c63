"""Token id arrays on the wire: packed little-endian int32 bytes.

A msgpack array of ints costs 1-5 bytes per id and a Python object per id to decode;
packed int32 is 4 bytes per id, decodes with one `np.frombuffer`, and the worker can
hand it to torch without a Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.protocol.errors import ProtocolError

TOKEN_DTYPE = np.dtype("<i4")  # explicit byte order: the wire format is the same on every host
TOKEN_BYTES = TOKEN_DTYPE.itemsize
_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as little-endian int32 bytes (4 bytes per id).

    Raises `ProtocolError` for anything that would not survive the round trip:
    non-integer values (floats, bools), more than one dimension, or ids outside
    the int32 range (numpy's own cast would wrap them silently).
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if len(tokens) == 0:
            return b""  # np.asarray([]) is float64; an empty list is fine as it is
        arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ProtocolError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        # object dtype: Python ints past int64, or mixed types.
        raise ProtocolError(f"token ids must be int32 integers, got dtype {arr.dtype}")
    if arr.dtype != TOKEN_DTYPE:
        low, high = int(arr.min()), int(arr.max())
        if low < _INT32_MIN or high > _INT32_MAX:
            bad = low if low < _INT32_MIN else high
            raise ProtocolError(f"token id {bad} is outside the int32 range")
        arr = arr.astype(TOKEN_DTYPE)
    return arr.tobytes()


def unpack_tokens_array(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Packed bytes -> a read-only int32 numpy view (no copy)."""
    num_tokens(data)
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def unpack_tokens(data: bytes | bytearray | memoryview) -> list[int]:
    """Packed bytes -> a list of Python ints."""
    ids: list[int] = unpack_tokens_array(data).tolist()
    return ids


def num_tokens(data: bytes | bytearray | memoryview) -> int:
    """How many ids a packed array holds; ProtocolError if the length is not whole ids.

    Pure Python on purpose: message `__post_init__` hooks call it for every item of
    every decoded batch, where a numpy call would cost more than the decode itself.
    """
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size % TOKEN_BYTES:
        raise ProtocolError(
            f"packed token ids must be a multiple of {TOKEN_BYTES} bytes, got {size} bytes"
        )
    return size // TOKEN_BYTES
