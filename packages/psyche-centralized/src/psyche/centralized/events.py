"""`--events-dir`: an append-only record of every coordinator state the server reached.

Upstream appends `i64 unix millis ‖ the raw in-memory bytes of the Rust Coordinator` (a memory
image only Rust can read) to `{events_dir}/coordinator/state.bin`. Here a record is

    i64 LE unix milliseconds ‖ u32 LE length ‖ postcard(Coordinator) (`length` bytes)

written whenever the encoded state differs from the previous record. A crash can leave a partial
record at the end: opening the file for appending cuts it off, and `read_events` stops before it.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from psyche.coordinator.coordinator import Coordinator
from psyche.core.serde import from_bytes

STATE_FILE = Path("coordinator") / "state.bin"
_HEADER = struct.Struct("<qI")


def _whole_records_end(data: bytes) -> int:
    """Offset just past the last complete record."""
    pos = 0
    while pos + _HEADER.size <= len(data):
        _, length = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end > len(data):
            break
        pos = end
    return pos


def read_events(path: Path | str) -> Iterator[tuple[int, Coordinator]]:
    """(unix millis, coordinator) of every complete record, oldest first."""
    data = Path(path).read_bytes()
    pos, end = 0, _whole_records_end(data)
    while pos < end:
        millis, length = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size : pos + _HEADER.size + length]
        yield millis, from_bytes(body, Coordinator)
        pos += _HEADER.size + length


class EventsWriter:
    """Appends a record when the state's bytes changed since the last one."""

    def __init__(self, events_dir: Path | str) -> None:
        self.path = Path(events_dir) / STATE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # noqa: SIM115 (closed by close())
        self._file.seek(0)
        existing = self._file.read()
        end = _whole_records_end(existing)
        if end != len(existing):
            self._file.truncate(end)
        self._file.seek(0, os.SEEK_END)
        self._last: bytes | None = None

    def record(self, encoded: bytes) -> bool:
        """Append `encoded` (a coordinator's postcard bytes) unless it repeats the last record."""
        if encoded == self._last:
            return False
        self._last = encoded
        self._file.write(_HEADER.pack(time.time_ns() // 1_000_000, len(encoded)) + encoded)
        self._file.flush()
        return True

    def close(self) -> None:
        self._file.close()


__all__ = ["STATE_FILE", "EventsWriter", "read_events"]
