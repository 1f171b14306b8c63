"""Token-bucket rate limiting, atomic in Redis (one Lua script per decision).

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; a request of
``cost`` tokens is allowed when that many are there. The script reads Redis's own
clock (``TIME``), so every gateway replica shares one bucket per key without
trusting its local clock. Idle buckets expire once they would be full again.
"""

from __future__ import annotations

from dataclasses import dataclass

# KEYS[1] bucket hash; ARGV: rate per second, burst, cost.
# Returns {allowed, tokens left, seconds until `cost` tokens are there}; numbers as
# strings because Redis truncates Lua numbers to integers on the way out.
TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local retry_after = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  retry_after = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, tostring(tokens), tostring(retry_after)}
"""


@dataclass(frozen=True)
class RateLimitDecision:
    """``allowed``: take the request. ``remaining``: tokens left after this decision
    (fractional; floor it for a header). ``retry_after_s``: 0 when allowed, else how
    long until ``cost`` tokens will be there."""

    allowed: bool
    remaining: float
    retry_after_s: float


def validate_bucket(rate_per_s: float, burst: int, cost: int) -> None:
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst}")
    if cost < 1:
        raise ValueError(f"cost must be >= 1, got {cost}")
    if cost > burst:
        raise ValueError(f"cost {cost} exceeds burst {burst}: it could never be allowed")


def parse_decision(reply: list[object]) -> RateLimitDecision:
    allowed, remaining, retry_after = reply
    return RateLimitDecision(
        allowed=int(str(allowed)) == 1,
        remaining=float(str(remaining)),
        retry_after_s=float(str(retry_after)),
    )
