"""From a `SubmitRequest` and its prompt ids to the `TokenizedRequest` the scheduler routes;
and where to send the error for a request too malformed to decode."""

from __future__ import annotations

import msgspec

from radixserve.prep.prompt import PromptIds
from radixserve.protocol import SubmitRequest, TokenizedRequest, check_token, pack_tokens


def tokenized_request(
    req: SubmitRequest, prompt: PromptIds, grammar_key: str | None = None
) -> TokenizedRequest:
    return TokenizedRequest(
        rid=req.rid,
        gateway_id=req.gateway_id,
        input_ids=pack_tokens(prompt.ids),
        sampling=req.sampling,
        grammar_key=grammar_key,
        stream=req.stream,
        priority=req.priority,
        arrival_time=req.arrival_time,
        model=req.model,
        resumable=req.resumable,
    )


class _Address(msgspec.Struct):
    """Only who sent a request: read from a body that fails full validation."""

    rid: str
    gateway_id: str


def request_address(data: bytes) -> tuple[str, str] | None:
    """(rid, gateway_id) of a body that is not a valid `SubmitRequest`, so the gateway
    still hears why; None when even those cannot be read (then only a log is left)."""
    try:
        address = msgspec.msgpack.decode(data, type=_Address)
        check_token(address.gateway_id, "gateway id")
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    return address.rid, address.gateway_id
