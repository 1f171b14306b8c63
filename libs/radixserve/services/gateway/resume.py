"""Streams that outlive their connection: event ids, what the record keeps, the replay.

A resumable request (every stream, and a non-streaming request sent with `X-Resumable:
true`, while `--resume-grace-s` is above 0) has its deltas kept by the detokenizer in the
store's output log (store/output_log.py) and its plan, less its prompts, in its record.
Each SSE event of such a stream carries `id: <response id>/<offsets>`, the offsets being
how many deltas of each of its rids the event follows (one number for one prompt, dotted
for more). A client that lost its connection sends that id back as `Last-Event-ID`, to
any gateway: re-POSTed to the endpoint it used, or with `GET /v1/requests/{id}/output`.
That gateway rebuilds the answer from the log, from the first delta (so every parser's
state is the original's), sends what follows the offsets, and then what comes, live.
The offsets are the deltas' numbers in the log (`TextDelta.seq`); after a detokenizer
restart they jump past a gap (store/output_log.py), and an id inside it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.api import ApiError, Assembly, ChoiceUpdate, GenerationPlan
from radixserve.api.errors import INVALID_REQUEST, SERVER_ERROR
from radixserve.auth import ApiKey
from radixserve.protocol import ProtocolError, TextDelta, decode_json
from radixserve.services.gateway.auth import forbidden
from radixserve.services.gateway.records import RecordWriter
from radixserve.store import FieldValue
from radixserve.store.output_log import OutputLog

# What a request id may be: checked before it is echoed in a header or used in a Redis
# key (a NUL or a newline there would break the response, not answer it).
REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
RESUMABLE_HEADER = "x-resumable"
LAST_EVENT_ID_HEADER = "last-event-id"
_READ_BLOCK_MS = 1000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    """Where a client's copy of a stream ends: the deltas it has of each rid."""

    response_id: str
    offsets: tuple[int, ...]

    @classmethod
    def parse(cls, event_id: str) -> ResumePoint:
        response_id, slash, counts = event_id.strip().rpartition("/")
        try:
            offsets = tuple(int(part) for part in counts.split("."))
        except ValueError:
            offsets = ()
        if not (slash and response_id) or not offsets or min(offsets) < 0:
            raise ApiError.invalid(
                "Last-Event-ID must be an event id of a radixserve stream (<request id>/<offset>)",
                "Last-Event-ID",
            )
        return cls(response_id, offsets)


async def owned_record(records: RecordWriter, rid: str, caller: ApiKey | None) -> dict[str, Any]:
    """The record of `rid`, if the caller may read it (its own, or with `admin`); else
    the ApiError to answer (400 not an id, 404 none, 403 another key's, 503 no store)."""
    if not REQUEST_ID.fullmatch(rid):
        raise ApiError.invalid("not a request id (letters, digits, . _ : -)", "id")
    try:
        record = await records.get(rid)
    except Exception as exc:
        log.warning("reading the request record failed: %r", exc, extra={"rid": rid})
        raise ApiError.unavailable("the request store is unavailable", "store_unavailable") from exc
    if record is None:
        raise ApiError(404, f"no record of request {rid!r}", INVALID_REQUEST, "id", "not_found")
    if caller is not None and record.get("api_key") != caller.name and not caller.has("admin"):
        raise forbidden(caller, "admin")
    return record


async def claim_request_id(records: RecordWriter, rid: str) -> str:
    """A client's own id for its resumable request (X-Request-Id with X-Resumable, so it
    can fetch a non-streaming answer it did not wait for): unused, or a 409."""
    if not REQUEST_ID.fullmatch(rid):
        raise ApiError.invalid("X-Request-Id: letters, digits, . _ : - (128 at most)", "id")
    try:
        taken = await records.get(rid) is not None
    except Exception as exc:
        raise ApiError.unavailable(
            "the request store is unavailable: nothing can be resumable now",
            "store_unavailable",
        ) from exc
    if taken:
        raise ApiError(409, f"request id {rid!r} is taken", INVALID_REQUEST, "id", "duplicate_id")
    return rid


def event_id_line(response_id: str, counts: Mapping[str, int], rids: tuple[str, ...]) -> bytes:
    offsets = ".".join(str(counts.get(rid, 0)) for rid in rids)
    return f"id: {response_id}/{offsets}\n".encode()


def tag_last(events: list[bytes], start: int, id_line: bytes) -> None:
    """Give the last event from `start` on the id (an SSE id only takes effect with its
    event's data, and one update's events go out in one write)."""
    if len(events) > start:
        events[-1] = id_line + events[-1]


def asked_resumable(headers: Mapping[str, str]) -> bool | None:
    """`X-Resumable`: True or False as the client said, None when it did not say."""
    said = headers.get(RESUMABLE_HEADER, "").strip().lower()
    if said in ("true", "1", "yes"):
        return True
    if said in ("false", "0", "no"):
        return False
    return None


def resumable_plan(plan: GenerationPlan) -> GenerationPlan:
    """The plan with its submits marked resumable (their deltas go to the output log)."""
    submits = tuple(msgspec.structs.replace(s, resumable=True) for s in plan.submits)
    return dataclasses.replace(plan, submits=submits)


def record_fields(plan: GenerationPlan, created: int) -> dict[str, FieldValue]:
    """What a gateway needs to rebuild the answer: the plan less its prompts (the deltas
    carry what the answer says of them) and the answer's `created`."""
    submits = tuple(
        msgspec.structs.replace(s, text=None, messages=None, input_ids=b"", tools=None)
        for s in plan.submits
    )
    light = dataclasses.replace(plan, submits=submits)
    return {"resumable": 1, "created": created, "plan": msgspec.json.encode(light).decode()}


def plan_of(record: Mapping[str, Any]) -> tuple[GenerationPlan, int]:
    """The plan and `created` a record keeps (ApiError when it keeps none)."""
    if record.get("resumable") != 1 or "plan" not in record:
        raise ApiError(
            409,
            f"request {record.get('id')!r} is not resumable (a non-streaming request must "
            "be sent with X-Resumable: true)",
            INVALID_REQUEST,
            "id",
            "not_resumable",
        )
    try:
        plan = msgspec.json.decode(record["plan"], type=GenerationPlan)
        return plan, int(record["created"])
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, ValueError) as exc:
        raise ApiError.unavailable(
            f"the record of request {record.get('id')!r} cannot be read: {exc}", "bad_record"
        ) from exc


class Replay:
    """A resumed request: its deltas from the output log through a fresh assembly; the
    updates the client already has are marked `replaying` (built, not sent)."""

    def __init__(
        self,
        output_log: OutputLog,
        plan: GenerationPlan,
        point: ResumePoint,
        created: int,
        *,
        received_at: float,
        timeout_s: float,
        record_state: Callable[[], Awaitable[Mapping[str, Any] | None]],
    ) -> None:
        if len(point.offsets) != len(plan.rids):
            raise ApiError.invalid(
                f"Last-Event-ID has {len(point.offsets)} offset(s); the request has "
                f"{len(plan.rids)} prompt(s)",
                "Last-Event-ID",
            )
        self.output_log = output_log
        self.plan = plan
        self.created = created
        self.assembly = Assembly(plan)
        self.offsets = dict(zip(plan.rids, point.offsets, strict=True))
        self.counts = dict.fromkeys(plan.rids, 0)
        self.started = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = received_at + timeout_s  # wall clock: the request's own deadline
        self.record_state = record_state  # the record now (a failure, an expiry)
        self.replaying = False
        self.resumable = True
        self._after = dict.fromkeys(plan.rids, "0")
        self._read_count = dict.fromkeys(plan.rids, 0)
        self._pending: list[tuple[int, TextDelta]] = []  # (seq, delta)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def event_id(self) -> bytes:
        return event_id_line(self.plan.response_id, self.counts, self.plan.rids)

    async def next_update(self) -> ChoiceUpdate:
        while (update := self.ready_update()) is None:
            await self._read()
        return update

    def ready_update(self) -> ChoiceUpdate | None:
        while self._pending:
            seq, delta = self._pending.pop(0)
            self.counts[delta.rid] = seq + 1
            update = self.assembly.apply(delta)
            if update is not None:
                self.replaying = self.counts[delta.rid] <= self.offsets[delta.rid]
                return update
        return None

    async def _read(self) -> None:
        unfinished = set(self.assembly.unfinished_rids())
        after = {rid: entry for rid, entry in self._after.items() if rid in unfinished}
        if not after:
            raise ApiError.unavailable("the resumed request has no output left", "bad_record")
        found = await asyncio.wait_for(
            self.output_log.read(after, block_ms=_READ_BLOCK_MS), _READ_BLOCK_MS / 1000 + 5
        )
        for rid, entries in found.items():
            for entry in entries:
                try:
                    delta = decode_json(entry.delta, TextDelta)
                except ProtocolError as exc:
                    raise _incomplete(self.plan.response_id) from exc
                expected = self._read_count[rid]
                # Only a restarted detokenizer's rebuilt choice may jump (past its gap),
                # and not past the client's offset: it has deltas the log never got.
                jumped = delta.resent and entry.seq > expected
                if entry.seq != expected and not jumped:
                    raise _incomplete(self.plan.response_id)
                if jumped and expected < self.offsets[rid] <= entry.seq:
                    raise _incomplete(self.plan.response_id)
                self._read_count[rid] = entry.seq + 1
                self._pending.append((entry.seq, delta))
                self._after[rid] = entry.entry_id
        if not found:
            await self._check_alive(after)

    async def _check_alive(self, after: Mapping[str, str]) -> None:
        """Nothing new: fail as the request did, or as expired, or past its deadline."""
        record = await self.record_state()
        if record is not None and record.get("state") == "failed":
            status = int(record.get("http_status", 503))
            raise ApiError(
                status,
                f"the request failed ({record.get('error_code', 'error')})",
                INVALID_REQUEST if status < 500 else SERVER_ERROR,
                None,
                str(record.get("error_code", "error")),
            )
        never_read = [rid for rid, entry in after.items() if entry == "0"]
        if never_read and record is not None and record.get("state") == "finished":
            if not await self.output_log.exists(never_read[0]):
                raise ApiError(
                    410,
                    f"the output of request {self.plan.response_id!r} is no longer kept",
                    INVALID_REQUEST,
                    "id",
                    "output_expired",
                )
        if time.time() > self.deadline:
            raise ApiError.timeout(self.timeout_s)

    def close(self, error: ApiError | None = None, *, client_gone: bool = False) -> None:
        """Nothing to release: the run that owns the request is elsewhere."""

    def client_left(self) -> None:
        """A resumed stream's client left again: it may come back once more."""


def _incomplete(response_id: str) -> ApiError:
    return ApiError(
        410,
        f"the kept output of request {response_id!r} has a gap (the store missed part of "
        "it); it cannot be resumed",
        INVALID_REQUEST,
        "id",
        "output_incomplete",
    )
