"""One radix-cache eviction's host time against the size of the tree (CPU).

Builds a cache of N leaves (8 tokens each, distinct first pages) over a CPU pool, then
times `evict(8)` (one leaf) R times and reports the median in ms per N:

    python lab/probes/radix_evict.py [--nodes 1000 10000 50000] [--repeats 50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from radixserve.engine.kvcache.pool import KVPool
from radixserve.engine.kvcache.radix_cache import RadixCache

LEAF_TOKENS = 8


def eviction_ms(nodes: int, repeats: int, seed: int = 0) -> float:
    pool = KVPool(nodes * LEAF_TOKENS + 16, 1, 1, 8, torch.float32, "cpu")
    cache = RadixCache(pool)
    rnd = random.Random(seed)
    for i in range(nodes):
        # Distinct first two tokens, so every leaf hangs off its own path.
        key = [i % 40000, i // 40000] + [rnd.randrange(1000) for _ in range(LEAF_TOKENS - 2)]
        slots = pool.alloc(LEAF_TOKENS)
        assert slots is not None
        cache.insert(key, slots)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        cache.evict(LEAF_TOKENS)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    for nodes in args.nodes:
        print(f"{nodes:>7} leaves: one eviction {eviction_ms(nodes, args.repeats):.3f} ms (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
