"""Redis store: request records with TTL, atomic token-bucket rate limits, health.

    from radixserve.store import Store, StoreSettings
    store = await Store.connect(StoreSettings.from_env())

See ``radixserve.store.client`` for the full usage.
"""

from __future__ import annotations

from radixserve.store.client import FieldValue, Store, StoreConnectError, StoreHealth
from radixserve.store.ratelimit import RateLimitDecision
from radixserve.store.settings import StoreSettings

__all__ = [
    "FieldValue",
    "RateLimitDecision",
    "Store",
    "StoreConnectError",
    "StoreHealth",
    "StoreSettings",
]
