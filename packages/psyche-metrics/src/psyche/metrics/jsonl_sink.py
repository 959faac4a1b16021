"""A JSON-lines file of everything logged: the tracker that needs nothing installed.

One object per line, appended and flushed as it is written, so a run that dies keeps every
line before it and a reader (`pandas.read_json(path, lines=True)`, `jq`) can follow the file
while the run goes on:

    {"kind": "config", "time": 1764000000.1, "values": {"run_id": "test"}}
    {"kind": "log", "time": 1764000001.2, "step": 1, "values": {"train/loss": 2.3}}
    {"kind": "summary", "time": 1764000100.0, "values": {"train/loss": 1.1}}

`time` is when `log` was called (Unix seconds). Values are written as strict JSON: NaN and the
infinities become the strings "NaN", "Infinity" and "-Infinity".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from .tracker import MetricValue, json_safe


class JsonlSink:
    name = "jsonl"

    def __init__(self, path: Path, run_config: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._run_config = dict(run_config or {})
        self._file: IO[str] | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        if self._run_config:
            self._line("config", time.time(), None, self._run_config)

    def _line(
        self, kind: str, timestamp: float, step: int | None, values: Mapping[str, Any]
    ) -> None:
        assert self._file is not None
        obj: dict[str, Any] = {"kind": kind, "time": timestamp}
        if step is not None:
            obj["step"] = step
        obj["values"] = {k: json_safe(v) for k, v in values.items()}
        self._file.write(json.dumps(obj, allow_nan=False, default=str) + "\n")
        self._file.flush()

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        self._line("log", timestamp, step, metrics)

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        self._line("summary", timestamp, None, metrics)

    def close(self, timeout: float) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
