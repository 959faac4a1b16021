"""Experiment trackers: W&B, TensorBoard, a JSONL file and OpenTelemetry, several at once.

The client and the server log through this one interface (upstream's `shared/metrics`; this
package sits below both and imports only `psyche.core`):

    config = TrackerConfig.from_options(options)          # upstream's --wandb-* / --oltp-* flags
    tracker = build_tracker(
        config,
        service=ServiceInfo.from_env("psyche-centralized-client", identity, run_id=run_id),
        run_name=f"{run_id}-{identity}",
    )                                                    # one clear error if misconfigured
    tracker.log({names.TRAIN_LOSS: 2.31, names.TRAIN_LR: 4e-4}, step=12)   # never blocks
    tracker.finish()                                     # bounded flush at the end

`build_tracker` returns a `CompositeTracker` of one `ThreadedTracker` per sink asked for (or a
`NoopTracker` when none is): `log` copies the values onto each sink's bounded queue and
returns; each sink writes from its own thread, drops with a counted warning when it falls
behind, and is switched off with one warning when it fails. The third-party libraries are
optional extras of psyche-metrics (`wandb`, `tensorboard`, `otel`), imported only when their
tracker is asked for; a missing one is a `MissingExtraError` naming the extra to install.

This is the package's public face: other packages import these names, and the `names` module
of metric keys, from `psyche.metrics`, never its other modules (an import-linter contract).
"""

from __future__ import annotations

from . import names
from .build import DeferredSink, build_sinks, build_tracker, import_sink_module, require_extra
from .config import (
    MissingExtraError,
    ServiceInfo,
    TrackerConfig,
    TrackerConfigError,
    WandbInfo,
    wandb_info,
)
from .jsonl_sink import JsonlSink
from .threaded import Sink, ThreadedTracker
from .tracker import (
    DEFAULT_FINISH_TIMEOUT,
    CompositeTracker,
    Metrics,
    MetricValue,
    NoopTracker,
    Tracker,
)

__all__ = [
    "DEFAULT_FINISH_TIMEOUT",
    "CompositeTracker",
    "DeferredSink",
    "JsonlSink",
    "MetricValue",
    "Metrics",
    "MissingExtraError",
    "NoopTracker",
    "ServiceInfo",
    "Sink",
    "ThreadedTracker",
    "Tracker",
    "TrackerConfig",
    "TrackerConfigError",
    "WandbInfo",
    "build_sinks",
    "build_tracker",
    "import_sink_module",
    "names",
    "require_extra",
    "wandb_info",
]
