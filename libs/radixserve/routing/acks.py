"""Run messages sent to workers and not acknowledged yet.

The scheduler publishes each `RoutedRequest` with a reply subject of its own (one token
per send) and the worker acknowledges on receipt with an empty message there. A send
still unacknowledged after `timeout_s` was lost on the way (the worker's connection
dropped it, or it stopped listening while still heartbeating): its request must not
wait out the gateway's request timeout. No I/O here.

    acks = PendingAcks(timeout_s=10.0)
    token = acks.sent(rid, worker_id, time.monotonic())   # reply to subjects.scheduler_ack(id, token)
    acks.acked(token)                                    # -> (rid, worker_id), or None if late
    for rid, worker_id in acks.expired(time.monotonic()): ...   # lost: unroute, 503, abort
"""

from __future__ import annotations


class PendingAcks:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the ack timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._next = 0
        # token -> (rid, worker id, deadline); one timeout, so deadlines rise in order.
        self._pending: dict[str, tuple[str, str, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def sent(self, rid: str, worker_id: str, now: float) -> str:
        """The reply token of a run message sent now."""
        self._next += 1
        token = str(self._next)
        self._pending[token] = (rid, worker_id, now + self.timeout_s)
        return token

    def acked(self, token: str) -> tuple[str, str] | None:
        """(rid, worker id) of an acknowledged send; None for a token expired or unknown."""
        entry = self._pending.pop(token, None)
        return None if entry is None else entry[:2]

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(rid, worker id) of every send past its deadline, oldest first (forgotten)."""
        lost = []
        for token, (rid, worker_id, deadline) in list(self._pending.items()):
            if deadline > now:
                break
            del self._pending[token]
            lost.append((rid, worker_id))
        return lost
