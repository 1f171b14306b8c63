"""Send the workload: Poisson arrivals (or all at once) under an optional concurrency cap.

    results, duration_s = await run_requests(specs, send, request_rate=4.0,
                                             max_concurrency=8, rng=random.Random(1))

Requests start in dataset order (the semaphore is first come, first served), so a
generated-shared-prefix workload reaches the server group by group.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from tqdm import tqdm

from radixserve.benchmark.client import RequestResult, RequestSpec

Send = Callable[[RequestSpec], Awaitable[RequestResult]]


def arrival_gaps(n: int, request_rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: 0 for the first, then exponential gaps of
    mean 1/rate (a Poisson process); all 0 for an infinite rate."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    return [0.0 if i == 0 else rng.expovariate(request_rate) for i in range(n)]


async def run_requests(
    specs: Sequence[RequestSpec],
    send: Send,
    request_rate: float,
    max_concurrency: int | None,
    rng: random.Random,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    gaps = arrival_gaps(len(specs), request_rate, rng)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), disable=not progress, desc="requests", unit="req")

    async def one(spec: RequestSpec) -> RequestResult:
        if slots is None:
            result = await send(spec)
        else:
            async with slots:
                result = await send(spec)
        bar.update(1)
        return result

    started = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    try:
        for gap, spec in zip(gaps, specs, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return list(results), time.perf_counter() - started
