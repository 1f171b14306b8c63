"""When a request's tokens reached the gateway: time to first token and inter-token latency.

times = TokenTimes(started=time.monotonic())
ttft_s, itl_s = times.on_tokens(choice=(rid, 0), count=3, now=time.monotonic())
# ttft_s: set on the request's first tokens; itl_s: the gap since the choice's last
# tokens divided by `count` (one observation per token, as SGLang and vLLM count it)
"""

from __future__ import annotations

from collections.abc import Hashable


class TokenTimes:
    def __init__(self, started: float) -> None:
        self.started = started
        self.first_token_at: float | None = None
        self._last_at: dict[Hashable, float] = {}  # choice -> its last tokens' arrival

    def on_tokens(
        self, choice: Hashable, count: int, now: float
    ) -> tuple[float | None, float | None]:
        """`count` new tokens of `choice` (e.g. (rid, index)) arrived at `now` (monotonic s).
        Returns (TTFT if these are the request's first, per-token gap if not the choice's first)."""
        ttft = None
        if self.first_token_at is None:
            self.first_token_at = now
            ttft = now - self.started
        if count <= 0:
            return ttft, None
        last = self._last_at.get(choice)
        self._last_at[choice] = now
        if last is None:
            return ttft, None
        return ttft, (now - last) / count
