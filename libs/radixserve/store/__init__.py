"""Redis store: request records with TTL, atomic token-bucket rate limits, health.

    from radixserve.store import Store, StoreSettings
    store = await Store.connect(StoreSettings.from_env())

See ``radixserve.store.client`` for the full usage.
"""

from __future__ import annotations

from radixserve.store.client import (
    FieldValue,
    Store,
    StoreAuthError,
    StoreConnectError,
    StoreHealth,
)
from radixserve.store.ratelimit import Bucket, RateLimitDecision
from radixserve.store.settings import RedisAuth, StoreSettings

__all__ = [
    "Bucket",
    "FieldValue",
    "RateLimitDecision",
    "RedisAuth",
    "Store",
    "StoreAuthError",
    "StoreConnectError",
    "StoreHealth",
    "StoreSettings",
]
