"""The output log across a detokenizer restart (real redis-server): the new one numbers a
request it rebuilt after the log's last entry, past a gap; a replay goes over the gap
only at the rebuilt (`resent`) delta, skips by its offsets what the old deltas had, and
refuses an event id inside the gap (the client has deltas the log never got).

The reference: the words the request produced, each once, in order.
"""

from __future__ import annotations

import uuid

import pytest

from radixserve.api import ApiError
from radixserve.protocol import FinishReason, TextDelta, encode_json, pack_tokens
from radixserve.services.gateway.resume import Replay
from radixserve.store import Store
from radixserve.store.output_log import RESYNC_SEQ_GAP, LogEntry, OutputLog, OutputLogWriter
from tests.integration.test_output_log import WORDS, collect, replay_of

pytestmark = pytest.mark.timeout(30)

KILLED_AT = 7  # the old detokenizer published deltas 0..6
LOGGED = 5  # ... of which 0..4 reached the log (5 and 6 were in its writer's queue)
REBUILT_AT = 9  # the new one's first delta: words 0..8, from the worker's history


def delta(rid: str, first: int, last: int, *, resent: bool = False) -> TextDelta:
    """The words [first, last) in one delta, with its offsets."""
    words = WORDS[first:last]
    return TextDelta(
        rid=rid,
        text="".join(words),
        token_ids=pack_tokens([100 + i for i in range(first, last)]),
        prompt_tokens=2,
        completion_tokens=last,
        finish_reason=FinishReason(kind="length") if last == len(WORDS) else None,
        text_offset=len("".join(WORDS[:first])),
        token_offset=first,
        resent=resent,
    )


async def write_restarted_log(output_log: OutputLog, rid: str) -> list[int]:
    """The log as the two detokenizers leave it; the numbers the live gateway gave out."""
    old = [LogEntry(rid, i, encode_json(delta(rid, i, i + 1))) for i in range(LOGGED)]
    await output_log.append(old)
    writer = OutputLogWriter(output_log, on_dropped=lambda count: None)
    assert not writer.knows(rid)
    last = await output_log.last_seqs([rid, "never-seen"])
    assert last == {rid: LOGGED - 1, "never-seen": -1}
    writer.continue_after(rid, last[rid])
    new = [delta(rid, 0, REBUILT_AT, resent=True)]
    new += [delta(rid, i, i + 1) for i in range(REBUILT_AT, len(WORDS))]
    seqs = [writer.number(rid) for _ in new]
    assert seqs[0] == LOGGED + RESYNC_SEQ_GAP and seqs == list(range(seqs[0], seqs[0] + len(new)))
    await output_log.append(
        [LogEntry(rid, seq, encode_json(d)) for seq, d in zip(seqs, new, strict=True)]
    )
    return list(range(1, KILLED_AT + 1)) + [seq + 1 for seq in seqs]


async def sent_texts(replay: Replay) -> list[str]:
    """The text of each update the replay sends (not the ones the client has)."""
    texts = []
    while not replay.assembly.done:
        update = await replay.next_update()
        if not replay.replaying:
            texts.append(update.delta.text)
    return texts


@pytest.mark.parametrize("client_has", [0, 3, LOGGED])
async def test_a_client_from_before_the_gap_gets_exactly_the_rest(
    store: Store, client_has: int
) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    await write_restarted_log(output_log, rid)
    replay = replay_of(output_log, rid, offset=client_has)
    assert "".join(await sent_texts(replay)) == "".join(WORDS[client_has:])
    (choice,) = replay.assembly.choices
    assert choice.text == "".join(WORDS) and choice.token_ids == [100 + i for i in range(12)]
    assert replay.assembly.usage().completion_tokens == len(WORDS)


async def test_a_client_from_after_the_rebuilt_delta_gets_exactly_the_rest(store: Store) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    ids = await write_restarted_log(output_log, rid)
    rebuilt_id = ids[KILLED_AT]  # the event id of the rebuilt delta
    replay = replay_of(output_log, rid, offset=rebuilt_id + 1)  # it had words 0..9
    assert "".join(await sent_texts(replay)) == "".join(WORDS[REBUILT_AT + 1 :])


@pytest.mark.parametrize("client_has", [LOGGED + 1, KILLED_AT])
async def test_an_event_id_inside_the_gap_is_refused(store: Store, client_has: int) -> None:
    output_log = OutputLog(store, ttl_s=30)
    rid = f"cmpl-{uuid.uuid4().hex}"
    await write_restarted_log(output_log, rid)
    with pytest.raises(ApiError) as refused:
        await collect(replay_of(output_log, rid, offset=client_has))
    assert (refused.value.status, refused.value.code) == (410, "output_incomplete")
