"""Closed integer intervals, and a map from disjoint intervals to values (which batch is whose)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Generic, TypeVar

from psyche.core.serde import U64, struct

V = TypeVar("V")


@struct(frozen=True)
class ClosedInterval:
    """`[start, end]`, both ends included; ordered by (start, end).

    Building it directly does not check `start <= end` (as a Rust struct literal, or a value read
    from the wire); `ClosedInterval.new` does.
    """

    start: U64
    end: U64

    @classmethod
    def new(cls, start: int, end: int) -> ClosedInterval:
        if start > end:
            raise ValueError("Start must be less than or equal to end")
        return cls(start, end)

    def contains(self, point: int) -> bool:
        return self.start <= point <= self.end

    def overlaps(self, other: ClosedInterval) -> bool:
        return self.start <= other.end and other.start <= self.end

    def _key(self) -> tuple[int, int]:
        return (self.start, self.end)

    def __lt__(self, other: ClosedInterval) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() < other._key()

    def __le__(self, other: ClosedInterval) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() <= other._key()

    def __gt__(self, other: ClosedInterval) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() > other._key()

    def __ge__(self, other: ClosedInterval) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() >= other._key()

    def __str__(self) -> str:
        if self.start == self.end:
            return str(self.start)
        return f"[{self.start}, {self.end}]"


class IntervalTree(Generic[V]):
    """Disjoint intervals keyed by their start, each with a value; point lookups in O(log n)."""

    __slots__ = ("_entries", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: dict[int, tuple[ClosedInterval, V]] = {}

    def clear(self) -> None:
        self._starts.clear()
        self._entries.clear()

    def insert(self, interval: ClosedInterval, value: V) -> None:
        """Raises ValueError("Overlapping interval") if `interval` meets one already present."""
        starts = self._starts
        i = bisect.bisect_right(starts, interval.start)
        # the entry with the greatest start <= interval.start (catches an equal start too)
        if i > 0 and self._entries[starts[i - 1]][0].end >= interval.start:
            raise ValueError("Overlapping interval")
        # the entry with the least start >= interval.start
        j = bisect.bisect_left(starts, interval.start)
        if j < len(starts) and self._entries[starts[j]][0].start <= interval.end:
            raise ValueError("Overlapping interval")
        starts.insert(j, interval.start)
        self._entries[interval.start] = (interval, value)

    def get(self, point: int) -> V | None:
        i = bisect.bisect_right(self._starts, point)
        if i == 0:
            return None
        interval, value = self._entries[self._starts[i - 1]]
        return value if interval.contains(point) else None

    def remove(self, interval: ClosedInterval) -> V | None:
        """Remove the entry starting at `interval.start`; its value only if the interval matches.

        Upstream quirk kept: an entry with the same start but a different end is removed too
        (and None returned).
        """
        entry = self._entries.pop(interval.start, None)
        if entry is None:
            return None
        self._starts.remove(interval.start)
        stored, value = entry
        return value if stored == interval else None

    def iter(self) -> Iterator[tuple[ClosedInterval, V]]:
        """Entries in ascending order of start."""
        for start in self._starts:
            yield self._entries[start]

    __iter__ = iter

    def __len__(self) -> int:
        return len(self._starts)

    def __str__(self) -> str:
        # Grouped by value like upstream; in order of first appearance (upstream: hash order).
        if not self._starts:
            return "IntervalTree {}"
        groups: dict[V, list[ClosedInterval]] = {}
        for interval, value in self.iter():
            groups.setdefault(value, []).append(interval)
        body = ", ".join(
            f"{value}: {', '.join(str(i) for i in intervals)}"
            for value, intervals in groups.items()
        )
        return f"IntervalTree {{ {body} }}"
