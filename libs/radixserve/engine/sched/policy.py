"""Order in which waiting requests are offered to the prefill adder.

lpm: longest cached prefix first, so requests that share a hot prefix run while
it is cached. fcfs: arrival order. dfs-weight: walk the radix tree depth-first,
heaviest subtree (most waiting requests under it) first, so requests sharing a
prefix run back to back.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from radixserve.engine.request import Req
from radixserve.engine.sched.kv_manager import KVManager


def order_waiting(
    policy: str, waiting: list[Req], kv: KVManager, lpm_max_waiting: int
) -> list[Req]:
    if policy == "fcfs" or not kv.cache.reuses_prefixes:
        return sorted(waiting, key=lambda r: r.arrival_order)
    if policy == "lpm" and len(waiting) > lpm_max_waiting:
        # Matching every waiting request each step costs more than it saves here.
        return sorted(waiting, key=lambda r: r.arrival_order)
    prefix_lens = {id(r): kv.match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-prefix_lens[id(r)], r.arrival_order))
    return _dfs_weight(waiting)


def _path(node: Any) -> list[Any]:
    # NOTE: reads only `parent`, which every tree node of the radix cache has.
    path = []
    while node is not None:
        path.append(node)
        node = getattr(node, "parent", None)
    return path[::-1]


def _dfs_weight(waiting: list[Req]) -> list[Req]:
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, list[Any]] = defaultdict(list)
    at_node: dict[int, list[Req]] = defaultdict(list)
    roots: list[Any] = []
    seen: set[int] = set()
    for req in sorted(waiting, key=lambda r: r.arrival_order):
        path = _path(req.last_node)
        at_node[id(path[-1])].append(req)
        for parent, child in zip([None, *path[:-1]], path, strict=True):
            weight[id(child)] += 1
            if id(child) not in seen:
                seen.add(id(child))
                (roots if parent is None else children[id(parent)]).append(child)
    ordered: list[Req] = []
    stack = sorted(roots, key=lambda n: weight[id(n)])
    while stack:
        node = stack.pop()
        ordered.extend(at_node[id(node)])
        stack.extend(sorted(children[id(node)], key=lambda n: weight[id(n)]))
    return ordered
