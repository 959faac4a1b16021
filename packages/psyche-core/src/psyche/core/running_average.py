"""Named moving averages over the last N samples (evaluation scores, step timings)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Entry:
    max_size: int
    min_samples: int
    buffer: deque[float] = field(default_factory=deque)
    total: float = 0.0
    all_time_pushes: int = 0

    def push(self, value: float) -> None:
        # Keep upstream's running sum (subtract the evicted value) so averages match it exactly.
        if len(self.buffer) == self.max_size and self.buffer:
            self.total -= self.buffer.popleft()
        self.buffer.append(value)
        self.total += value
        self.all_time_pushes += 1

    def average(self) -> float | None:
        if len(self.buffer) <= self.min_samples:
            return None
        return self.total / len(self.buffer)


class RunningAverage:
    """Thread-safe: evaluation workers push while the client reads."""

    __slots__ = ("_entries", "_lock")

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def add_entry_if_needed(self, name: str, buffer: int, min_samples: int | None = None) -> None:
        with self._lock:
            if name not in self._entries:
                self._entries[name] = _Entry(max_size=buffer, min_samples=min_samples or 0)

    def push(self, name: str, value: float) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(f"Missing RunningAverage entry {name!r}")
            entry.push(float(value))

    def sample(self, name: str) -> float | None:
        """The average, or None when the entry is missing or has too few samples."""
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else entry.average()

    def get_all_averages(self) -> dict[str, float | None]:
        with self._lock:
            return {name: entry.average() for name, entry in self._entries.items()}

    def all_time_pushes(self, name: str) -> int | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else entry.all_time_pushes
