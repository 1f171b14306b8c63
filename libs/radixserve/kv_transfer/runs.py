"""Pair source and destination slots into runs that are consecutive on both sides.

One run is one transfer request per buffer, so a request's pages that stay
contiguous on both workers cost one request instead of one per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotRun:
    """`length` slots from `src` onward go to `length` slots from `dst` onward."""

    src: int
    dst: int
    length: int


def coalesce_runs(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[SlotRun]:
    """Runs covering src_slots[i] -> dst_slots[i] for every i, in order; a run grows
    while both the next source and the next destination slot follow on by one."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots for {len(dst_slots)} destination slots")
    runs: list[SlotRun] = []
    start = 0
    for i in range(1, len(src_slots) + 1):
        ends_here = (
            i == len(src_slots)
            or src_slots[i] != src_slots[i - 1] + 1
            or dst_slots[i] != dst_slots[i - 1] + 1
        )
        if ends_here:
            runs.append(SlotRun(src_slots[start], dst_slots[start], i - start))
            start = i
    return runs
