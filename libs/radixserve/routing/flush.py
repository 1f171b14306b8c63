"""One answer to `POST /flush_cache` from every ready worker's answer."""

from __future__ import annotations

from collections.abc import Mapping

from radixserve.protocol import FlushCacheReply


def merge_flush_replies(rid: str, replies: Mapping[str, FlushCacheReply | str]) -> FlushCacheReply:
    """ok only when every worker answered ok; a str value is why a worker did not answer.

    No worker at all is not ok: nothing confirmed the flush.
    """
    if not replies:
        return FlushCacheReply(rid=rid, ok=False, message="no ready worker to flush")
    failures = []
    for worker_id, reply in sorted(replies.items()):
        if isinstance(reply, str):
            failures.append(f"{worker_id}: {reply}")
        elif not reply.ok:
            failures.append(f"{worker_id}: {reply.message or 'refused'}")
    if failures:
        return FlushCacheReply(rid=rid, ok=False, message="; ".join(failures))
    return FlushCacheReply(rid=rid, ok=True, message=f"flushed {len(replies)} worker(s)")
