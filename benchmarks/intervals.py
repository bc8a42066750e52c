"""Time intervals (start, end), as profiles give them: their union, length and intersections."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator

Interval = tuple[float, float]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (touching ones joined)."""
    union: list[Interval] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def covered(union: list[Interval], start: float, end: float) -> float:
    """How much of [start, end) the sorted disjoint intervals `union` cover."""
    first = max(bisect.bisect_right(union, (start, math.inf)) - 1, 0)
    total = 0.0
    for a, b in union[first:]:
        if a >= end:
            break
        total += max(0.0, min(b, end) - max(a, start))
    return total


def uncovered(union: list[Interval], start: float, end: float) -> Iterator[Interval]:
    """The parts of [start, end) outside the sorted disjoint intervals `union`."""
    cursor = start
    for c_start, c_end in union:
        if c_end <= cursor:
            continue
        if c_start >= end:
            break
        if c_start > cursor:
            yield cursor, c_start
        cursor = max(cursor, c_end)
    if cursor < end:
        yield cursor, end
