"""Order in which waiting requests are offered to the prefill adder.

Priority first: a higher `Req.priority` is offered first, and ahead of every level
come the requests that have waited longer than the starvation bound (config
`priority_starvation_s`; 0: none), by arrival, so that a steady stream of
higher-priority requests cannot hold a lower one back for ever. Within one level the
schedule policy orders:

lpm: longest cached prefix first, so requests that share a hot prefix run while
it is cached. fcfs: arrival order. dfs-weight: walk the radix tree depth-first,
heaviest subtree (most waiting requests under it) first, so requests sharing a
prefix run back to back.

While every waiting request has one priority (the common case) the policy alone
orders them, as it did before priorities, and no clock is read: the bound limits how
long a higher priority holds a lower one back, not the policy's own order. This is
admission order only: running requests, and the one mid-chunk, are never preempted
for a higher priority.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from radixserve.engine.request import Req
from radixserve.engine.sched.kv_manager import KVManager


def order_waiting(
    policy: str,
    waiting: list[Req],
    kv: KVManager,
    lpm_max_waiting: int,
    now: float,
    starvation_s: float,
) -> list[Req]:
    """`now`: the scheduler clock's reading, which `Req.arrival_time`s compare against."""
    policy = _effective_policy(policy, len(waiting), kv, lpm_max_waiting)
    first = waiting[0].priority if waiting else 0
    if all(r.priority == first for r in waiting):
        return _by_policy(policy, waiting, kv)
    starved: list[Req] = []
    levels: dict[int, list[Req]] = defaultdict(list)
    for req in waiting:
        if _starved(req, now, starvation_s):
            starved.append(req)
        else:
            levels[req.priority].append(req)
    ordered = sorted(starved, key=lambda r: (r.arrival_time, r.arrival_order))
    for priority in sorted(levels, reverse=True):
        ordered.extend(_by_policy(policy, levels[priority], kv))
    return ordered


def _starved(req: Req, now: float, starvation_s: float) -> bool:
    return (
        starvation_s > 0 and req.arrival_time is not None and now - req.arrival_time > starvation_s
    )


def _effective_policy(policy: str, num_waiting: int, kv: KVManager, lpm_max_waiting: int) -> str:
    if not kv.cache.reuses_prefixes:
        return "fcfs"  # no prefix to match or tree to walk
    if policy == "lpm" and num_waiting > lpm_max_waiting:
        # Matching every waiting request each step costs more than it saves here.
        return "fcfs"
    return policy


def _by_policy(policy: str, reqs: list[Req], kv: KVManager) -> list[Req]:
    if policy == "fcfs":
        return sorted(reqs, key=lambda r: r.arrival_order)
    prefix_lens = {id(r): kv.match(r) for r in reqs}  # dfs-weight reads the nodes it sets
    if policy == "lpm":
        return sorted(reqs, key=lambda r: (-prefix_lens[id(r)], r.arrival_order))
    return _dfs_weight(reqs)


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
