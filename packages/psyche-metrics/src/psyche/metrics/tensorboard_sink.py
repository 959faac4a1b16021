"""TensorBoard event files (`tensorboard --logdir DIR` shows them).

Written with tensorboardX (the `tensorboard` extra): the same event-file format as TensorBoard's
own writer, without TensorBoard's server, grpc and web assets, and without requiring torch
(tensorboardX imports it when it is installed). Each logged step is one event holding every
value: numbers as scalars under their key (`train/loss`, at the step and the time `log` was
called), strings as text summaries. The run config is one text summary `config` (a JSON
object); summary values are written under `summary/<key>` at the last step logged.

One event per step through tensorboardX's `FileWriter`, rather than `SummaryWriter.add_scalar`
per value: the latter costs some 60 times the CPU per step (1.5 ms against 25 us for the
17 values a client logs, measured with scripts/bench/trackers.py's values).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX import FileWriter
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import text

from .tracker import MetricValue, split_values

FLUSH_SECONDS = 10
"""tensorboardX's own writer thread writes the file out at least this often."""


def step_summary(metrics: Mapping[str, MetricValue], prefix: str = "") -> Summary:
    """One `Summary` with every value of a step: numbers as scalars, strings as text."""
    numbers, texts = split_values(metrics)
    values = [Summary.Value(tag=prefix + k, simple_value=float(v)) for k, v in numbers.items()]
    for key, value in texts.items():
        values.extend(text(prefix + key, value).value)
    return Summary(value=values)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, logdir: Path, run_config: Mapping[str, Any] | None = None) -> None:
        self.logdir = Path(logdir)
        self._run_config = dict(run_config or {})
        self._writer: FileWriter | None = None
        self._last_step = 0

    def open(self) -> None:
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = FileWriter(str(self.logdir), flush_secs=FLUSH_SECONDS)
        if self._run_config:
            config = json.dumps(self._run_config, default=str)
            self._writer.add_summary(text("config", config), global_step=0)

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        assert self._writer is not None
        self._last_step = step
        self._writer.add_summary(step_summary(metrics), global_step=step, walltime=timestamp)

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        assert self._writer is not None
        summary = step_summary(metrics, "summary/")
        self._writer.add_summary(summary, global_step=self._last_step, walltime=timestamp)

    def close(self, timeout: float) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
