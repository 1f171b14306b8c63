"""Which requests of a decode batch share a cached prefix, for cascade attention.

Each running request locks a path of the radix tree (its matched and inserted prompt).
Requests whose paths pass through the same node share that node's first tokens, in
the same KV slots. Each request joins the group of the DEEPEST node on its path that
another request of the batch also passes through (so a group's prefix is as long as
its members all share); groups of one are dropped. Cascade attention then reads each
group's prefix once per step instead of once per member (attention/cascade.py).

The scheduler asks for groups only where the runner runs cascade for a step of that
size (`ModelRunner.uses_cascade`: a graph size with a cascade variant, or an eager step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from radixserve.engine.forward_batch import SharedPrefix

# A prefix shorter than one key block of the kernels saves less than its kernel costs.
MIN_PREFIX_TOKENS = 64


def find_shared_prefixes(
    paths: Sequence[Sequence[tuple[int, int]]], min_length: int = MIN_PREFIX_TOKENS
) -> tuple[SharedPrefix, ...]:
    """Groups of batch indices by shared path node; paths[i] is request i's
    `PrefixCache.path` ((node id, tokens to the node's end), root side first)."""
    seen = Counter(node for path in paths for node, _ in path)
    groups: dict[int, tuple[int, list[int]]] = {}
    for i, path in enumerate(paths):
        for node, length in reversed(path):
            if length < min_length:
                break
            if seen[node] > 1:
                groups.setdefault(node, (length, []))[1].append(i)
                break
    return tuple(
        SharedPrefix(length, tuple(members))
        for length, members in groups.values()
        if len(members) > 1
    )
