"""Token-bucket rate limiting, atomic in Redis (one Lua script per decision).

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; a request of
``cost`` tokens is allowed when that many are there. One decision may cover several
buckets (a key's requests/min and tokens/min): it is allowed only when every bucket
has its cost, and then takes from all of them, else from none. A charge (`force`)
takes its cost whatever is there, so a bucket may go below zero: usage that is known
only after a request (its tokens) then delays the next ones. The script reads Redis's
own clock (``TIME``), so every gateway replica shares one bucket per key without
trusting its local clock. Idle buckets expire once they would be full again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# KEYS: the bucket hashes; ARGV: rate per second, burst, cost, force (0/1) per bucket.
# Returns {allowed, then per bucket: tokens left, seconds until its cost is there};
# numbers as strings because Redis truncates Lua numbers to integers on the way out.
TOKEN_BUCKETS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens = {}
local allowed = 1
for i = 1, #KEYS do
  local rate = tonumber(ARGV[4 * i - 3])
  local burst = tonumber(ARGV[4 * i - 2])
  local cost = tonumber(ARGV[4 * i - 1])
  local force = tonumber(ARGV[4 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local level = tonumber(state[1])
  local ts = tonumber(state[2])
  if level == nil or ts == nil then
    level = burst
    ts = now
  end
  level = math.min(burst, level + math.max(0, now - ts) * rate)
  tokens[i] = level
  if force == 0 and level < cost then
    allowed = 0
  end
end
local reply = {allowed}
for i = 1, #KEYS do
  local rate = tonumber(ARGV[4 * i - 3])
  local burst = tonumber(ARGV[4 * i - 2])
  local cost = tonumber(ARGV[4 * i - 1])
  local level = tokens[i]
  local retry_after = 0
  if allowed == 1 then
    level = level - cost
    if level < 0 then
      retry_after = -level / rate
    end
  elseif level < cost then
    retry_after = (cost - level) / rate
  end
  redis.call('HSET', KEYS[i], 'tokens', tostring(level), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((burst - level) / rate * 1000) + 1000)
  table.insert(reply, tostring(level))
  table.insert(reply, tostring(retry_after))
end
return reply
"""


@dataclass(frozen=True)
class Bucket:
    """One token bucket: its name (under the store's ``rl:`` prefix), how fast it
    refills, how much it holds, and what this decision takes from it."""

    key: str
    rate_per_s: float
    burst: int
    cost: int = 1

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("rate limit key must not be empty")
        if not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        if self.cost < 1:
            raise ValueError(f"cost must be >= 1, got {self.cost}")


@dataclass(frozen=True)
class RateLimitDecision:
    """``allowed``: take the request. ``remaining``: tokens left after this decision
    (fractional, below zero after a charge; floor it for a header). ``retry_after_s``: 0
    when allowed and not overdrawn, else how long until ``cost`` tokens will be there."""

    allowed: bool
    remaining: float
    retry_after_s: float


def check_allowable(bucket: Bucket) -> None:
    """A decision's cost must fit the bucket (a charge's need not: usage is what it is)."""
    if bucket.cost > bucket.burst:
        raise ValueError(
            f"cost {bucket.cost} exceeds burst {bucket.burst}: it could never be allowed"
        )


def bucket_args(buckets: Sequence[Bucket], force: bool) -> list[float | int]:
    args: list[float | int] = []
    for bucket in buckets:
        args += [bucket.rate_per_s, bucket.burst, bucket.cost, int(force)]
    return args


def parse_decisions(reply: list[object]) -> list[RateLimitDecision]:
    """One decision per bucket of the script's reply; each says the shared `allowed`."""
    allowed = int(str(reply[0])) == 1
    values = reply[1:]
    return [
        RateLimitDecision(
            allowed=allowed,
            remaining=float(str(values[i])),
            retry_after_s=float(str(values[i + 1])),
        )
        for i in range(0, len(values), 2)
    ]
