"""API keys in Redis, shared by every gateway replica: hashed, never in clear.

    keys = RedisKeys(store)
    await keys.create(entry)          # KeyExists if the name is taken
    await keys.lookup(sha256)         # ApiKey | None (one HGETALL)
    await keys.list(); await keys.revoke("ci")

`<prefix>apikey:<sha256>` is a hash of the entry's fields; `<prefix>apikeys` maps each
name to its hash, so a key is listed and revoked by name. Both change in one
transaction.
"""

from __future__ import annotations

import json
from typing import cast

from redis.exceptions import WatchError

from radixserve.auth.keys import ApiKey
from radixserve.store import Store


class KeyExists(ValueError):
    """A key of that name is already there."""


class RedisKeys:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._index = store.key("apikeys")

    def _entry_key(self, sha256: str) -> str:
        return self.store.key("apikey", sha256)

    async def lookup(self, sha256: str) -> ApiKey | None:
        raw = cast("dict[str, str]", await self.store.redis.hgetall(self._entry_key(sha256)))  # type: ignore[misc]
        if not raw:
            return None
        return ApiKey.from_dict(json.loads(raw["entry"]))

    async def create(self, entry: ApiKey) -> None:
        redis = self.store.redis
        async with redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(self._index)
                if await pipe.hexists(self._index, entry.name):  # type: ignore[misc]
                    raise KeyExists(f"a key named {entry.name!r} exists")
                pipe.multi()
                pipe.hset(self._index, entry.name, entry.sha256)
                pipe.hset(self._entry_key(entry.sha256), "entry", json.dumps(entry.to_dict()))
                await pipe.execute()
            except WatchError:
                raise KeyExists(f"a key named {entry.name!r} was created meanwhile") from None

    async def list(self) -> list[ApiKey]:
        index = cast("dict[str, str]", await self.store.redis.hgetall(self._index))  # type: ignore[misc]
        keys = [await self.lookup(sha) for sha in index.values()]
        return sorted((k for k in keys if k is not None), key=lambda k: k.name)

    async def revoke(self, name: str) -> bool:
        """True when a key of that name was there (and is gone now)."""
        redis = self.store.redis
        sha = cast("str | None", await redis.hget(self._index, name))  # type: ignore[misc]
        if sha is None:
            return False
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._index, name)
            pipe.delete(self._entry_key(sha))
            await pipe.execute()
        return True
