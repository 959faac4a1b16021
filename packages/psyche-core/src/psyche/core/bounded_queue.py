"""A queue that keeps only its newest items (recent step durations for client stats)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedQueue(Generic[T]):
    """Holds at most `max_len` items; pushing onto a full queue drops the oldest."""

    __slots__ = ("_max_len", "_queue")

    def __init__(self, max_len: int) -> None:
        if max_len < 0:
            raise ValueError(f"BoundedQueue max_len must be >= 0, got {max_len}")
        self._max_len = max_len
        self._queue: deque[T] = deque(maxlen=max_len)

    @property
    def max_len(self) -> int:
        return self._max_len

    def push(self, item: T) -> None:
        self._queue.append(item)

    def __iter__(self) -> Iterator[T]:
        return iter(self._queue)

    iter = __iter__

    def __len__(self) -> int:
        return len(self._queue)

    def is_empty(self) -> bool:
        return not self._queue
