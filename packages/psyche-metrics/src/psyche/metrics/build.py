"""From a `TrackerConfig` to the trackers it names, each running off the caller's thread.

`build_tracker` checks everything that can be checked before the run starts, on the caller's
thread, so a command reports it as one line before doing anything else: the settings
(`TrackerConfig.problems`), upstream's W&B rule (`wandb_info`), and that each tracker asked for
has its extra installed. What may be slow or need the network (importing wandb or
tensorboardX, creating the W&B run, the OTLP exports) happens on the trackers' own threads and,
when it fails, switches that tracker off with one warning. The OpenTelemetry sink alone is made
on the caller's thread (no network: its exports run on the SDK's threads) so that its log
handler sees the command's log records from the start.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from .config import MissingExtraError, ServiceInfo, TrackerConfig, TrackerConfigError, wandb_info
from .jsonl_sink import JsonlSink
from .threaded import Sink, ThreadedTracker
from .tracker import CompositeTracker, MetricValue, NoopTracker, Tracker

# extra -> (sink module, modules the extra installs, what it is for messages)
_EXTRAS = {
    "wandb": (".wandb_sink", ("wandb",), "Weights & Biases logging (--wandb-*)"),
    "tensorboard": (".tensorboard_sink", ("tensorboardX",), "TensorBoard logging"),
    "otel": (
        ".otel_sink",
        ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
        "OpenTelemetry export (--oltp-*)",
    ),
}


def require_extra(extra: str) -> None:
    """A `MissingExtraError` naming `extra` unless the packages it installs are there. Only
    looks (`importlib.util.find_spec`), imports nothing: a command checks its trackers before
    it starts, at no cost."""
    _, modules, what = _EXTRAS[extra]
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            raise MissingExtraError(what, extra)


def import_sink_module(extra: str) -> ModuleType:
    """The sink module of `extra` (importing its third-party package, which may take seconds:
    wandb about 1 s, tensorboardX loads torch when torch is installed)."""
    return importlib.import_module(_EXTRAS[extra][0], __package__)


class DeferredSink:
    """A sink made on the tracker's worker thread: `open` imports the sink's module and builds
    it there, so the caller's thread pays neither the import nor the construction."""

    def __init__(self, name: str, extra: str, make: Callable[[ModuleType], Sink]) -> None:
        self.name = name
        self._extra = extra
        self._make = make
        self.sink: Sink | None = None

    def open(self) -> None:
        self.sink = self._make(import_sink_module(self._extra))
        self.sink.open()

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        assert self.sink is not None
        self.sink.write(metrics, step, timestamp)

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        assert self.sink is not None
        self.sink.write_summary(metrics, timestamp)

    def close(self, timeout: float) -> None:
        if self.sink is not None:
            self.sink.close(timeout)


def build_sinks(
    config: TrackerConfig,
    *,
    service: ServiceInfo,
    run_name: str,
    run_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Sink]:
    """The sinks `config` asks for (not yet open), in a fixed order: W&B, TensorBoard, JSONL,
    OpenTelemetry. Raises `TrackerConfigError` (a `UserError`) for settings that cannot work."""
    problems = config.problems()
    if problems:
        raise TrackerConfigError("; ".join(problems))
    sinks: list[Sink] = []
    info = wandb_info(config, run_name, env)
    if info is not None:
        require_extra("wandb")
        sinks.append(DeferredSink("wandb", "wandb", lambda m: m.WandbSink(info, run_config)))
    if config.tensorboard_dir is not None:
        require_extra("tensorboard")
        logdir = config.tensorboard_dir
        sinks.append(
            DeferredSink(
                "tensorboard", "tensorboard", lambda m: m.TensorBoardSink(logdir, run_config)
            )
        )
    if config.metrics_jsonl is not None:
        sinks.append(JsonlSink(config.metrics_jsonl, run_config))
    if config.wants_otel:
        require_extra("otel")
        # made here, not on the worker thread: its log handler must be in place before the
        # command logs anything else (importing the SDK takes about 0.3 s, once)
        sinks.append(import_sink_module("otel").OtelSink(config, service))
    return sinks


def build_tracker(
    config: TrackerConfig,
    *,
    service: ServiceInfo,
    run_name: str,
    run_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    extra_sinks: list[Sink] | None = None,
) -> Tracker:
    """Every tracker `config` asks for, as one `Tracker`; a `NoopTracker` when none is.

    `service` says who reports (OpenTelemetry resource); `run_name` is the W&B run name when
    `--wandb-run` is not given; `run_config` is recorded once at the start (W&B config, a JSONL
    `config` line, a TensorBoard text); `env` is the environment the W&B rule reads
    (`os.environ` by default). `extra_sinks` are added after the configured ones. Each sink
    runs in a `ThreadedTracker` with `config.queue_size`."""
    sinks = build_sinks(
        config, service=service, run_name=run_name, run_config=run_config, env=env
    ) + list(extra_sinks or [])
    if not sinks:
        return NoopTracker()
    return CompositeTracker(
        [ThreadedTracker(sink, queue_size=config.queue_size) for sink in sinks],
        finish_timeout=config.finish_timeout,
    )
