"""A batch of training data: a closed interval of global sample indices."""

from __future__ import annotations

import re
from collections.abc import Iterator

from psyche.core.interval_tree import ClosedInterval
from psyche.core.numeric import U64_MAX
from psyche.core.serde import struct

# Rust's `u64::from_str`: an optional '+', ASCII digits, nothing else (no spaces, no '_').
_U64_TEXT = re.compile(r"\+?[0-9]+")


def _parse_u64(text: str) -> int | None:
    if _U64_TEXT.fullmatch(text) is None:
        return None
    value = int(text)
    return value if value <= U64_MAX else None


@struct(frozen=True)
class BatchId(ClosedInterval):
    """Upstream's newtype `BatchId(ClosedInterval<u64>)`: on the wire exactly `{start, end}`.

    Ordered and hashed by (start, end); shown as `B5` or `B[0, 24]`.
    """

    @classmethod
    def from_interval(cls, interval: ClosedInterval) -> BatchId:
        return cls(interval.start, interval.end)

    @property
    def interval(self) -> ClosedInterval:
        return ClosedInterval(self.start, self.end)

    @classmethod
    def from_str(cls, text: str) -> BatchId:
        """Parse `B[start,end]` exactly as upstream does.

        Upstream quirks kept: no space is allowed around the numbers, so the display form of a
        range (`B[1, 5]`) does not parse, and neither does a single-index form (`B5`).
        """
        s = text.lstrip("B")
        start_bracket = s.find("[")
        if start_bracket < 0:
            raise ValueError("Missing '[' in input")
        comma = s.find(",")
        if comma < 0:
            raise ValueError("Missing ',' in input")
        end_bracket = s.find("]")
        if end_bracket < 0:
            raise ValueError("Missing ']' in input")
        # Where upstream would slice backwards (and panic), raise instead, at the same point.
        if comma < start_bracket + 1:
            raise ValueError(f"malformed BatchId {text!r}: ',' before '['")
        start = _parse_u64(s[start_bracket + 1 : comma])
        if start is None:
            raise ValueError("Failed to parse start value")
        if end_bracket < comma + 1:
            raise ValueError(f"malformed BatchId {text!r}: ']' before ','")
        end = _parse_u64(s[comma + 1 : end_bracket])
        if end is None:
            raise ValueError("Failed to parse end value")
        return cls(start, end)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __len__(self) -> int:
        if self.end < self.start:
            raise ValueError(f"BatchId {self!r} has end < start")
        return self.end - self.start + 1

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        return "B" + ClosedInterval.__str__(self)

    __repr__ = __str__
