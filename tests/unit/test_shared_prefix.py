"""Grouping a decode batch by shared radix-cache prefixes (for cascade attention)."""

from __future__ import annotations

import torch

from radixserve.engine.forward_batch import SharedPrefix
from radixserve.engine.kvcache.naive_cache import NaiveCache
from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.sched.shared_prefix import find_shared_prefixes


def _pool() -> KVPool:
    return KVPool(512, 1, 1, 1, torch.float32, "cpu")


def _insert(cache: RadixCache, pool: KVPool, key: list[int]) -> object:
    slots = pool.alloc(len(key))
    assert slots is not None
    done = cache.insert(key, slots)
    pool.free(slots[:done])  # what the cache already held
    return cache.match_prefix(key).node


def test_radix_paths_share_the_split_node() -> None:
    pool = _pool()
    cache = RadixCache(pool)
    system = list(range(100, 180))
    a = _insert(cache, pool, [*system, 1, 2, 3])
    b = _insert(cache, pool, [*system, 4, 5])  # splits a's node after the system prompt
    c = _insert(cache, pool, [7, 8, 9])
    path_a, path_b, path_c = cache.path(a), cache.path(b), cache.path(c)
    assert [n for _, n in path_a] == [80, 83] and [n for _, n in path_b] == [80, 82]
    assert path_a[0][0] == path_b[0][0] and path_a[1][0] != path_b[1][0]
    assert [n for _, n in path_c] == [3]
    assert cache.path(cache.match_prefix([]).node) == []
    # The slots along the path are the matched ones.
    shared = cache.match_prefix(system).indices
    assert torch.equal(cache.match_prefix([*system, 4]).indices[:80], shared)
    assert torch.equal(cache.match_prefix([*system, 1]).indices[:80], shared)


def test_naive_cache_has_no_paths() -> None:
    cache = NaiveCache(_pool())
    assert cache.path(cache.match_prefix([1, 2, 3]).node) == []


def test_groups_take_the_deepest_node_shared_within_the_batch() -> None:
    system = (1, 2048)
    paths = [
        [system, (10, 2176)],  # 0
        [system, (11, 2100)],  # 1
        [(5, 300)],  # 2: alone
        [system, (12, 2190), (20, 2300)],  # 3
        [system, (12, 2190), (21, 2290)],  # 4: shares node 12 with 3
        [(6, 100), (7, 200)],  # 5
        [(6, 100), (8, 150)],  # 6: shares node 6 with 5
    ]
    groups = find_shared_prefixes(paths)
    assert set(groups) == {
        SharedPrefix(2048, (0, 1)),
        SharedPrefix(2190, (3, 4)),
        SharedPrefix(100, (5, 6)),
    }


def test_short_prefixes_and_single_members_are_not_groups() -> None:
    paths = [[(1, 40), (2, 90)], [(1, 40), (3, 70)], [(4, 500)], []]
    assert find_shared_prefixes(paths, min_length=64) == ()
    assert find_shared_prefixes(paths, min_length=32) == (SharedPrefix(40, (0, 1)),)
