"""The logger interface every experiment tracker offers, and the composite that fans one call
out to several (Levanter's `CompositeTracker`, torchtitan's `BaseLogger`).

A tracker takes one flat dictionary of scalars per step. Keys are slash-separated names
(`train/loss`, `coordinator/epoch`: see `psyche.metrics.names`); values are numbers
(`int`, `float`, `bool`) or short strings. Every tracker here promises the same three things to
its caller, which is a training loop or a server tick:

* `log` and `log_summary` never block on I/O and never raise;
* a tracker that fails stops on its own, with one warning, and takes no other tracker with it;
* `finish` returns within its timeout, whatever the sinks behind it are doing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self

log = logging.getLogger(__name__)

MetricValue = float | int | bool | str
"""What a tracker records: a number (bool counts as 0/1) or a short string."""

Metrics = Mapping[str, MetricValue]
"""One step's values, by name."""

DEFAULT_FINISH_TIMEOUT = 10.0
"""Seconds `finish` waits for every sink to write what it was given and close, at most."""


class Tracker(ABC):
    """Where a run's metrics go. `log` and `log_summary` return at once; `finish` flushes.

    Usable as a context manager: leaving the block calls `finish()`."""

    @abstractmethod
    def log(self, metrics: Metrics, step: int) -> None:
        """Record `metrics` as the values of step `step` (steps only grow within a run)."""

    @abstractmethod
    def log_summary(self, metrics: Metrics) -> None:
        """Record values that describe the whole run (final loss, total tokens)."""

    @abstractmethod
    def finish(self, timeout: float | None = None) -> None:
        """Write out what was logged and close, returning within `timeout` seconds (None: the
        tracker's own default, `DEFAULT_FINISH_TIMEOUT` unless configured). Values logged
        afterwards are ignored. Calling it again does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish()


class NoopTracker(Tracker):
    """No tracker configured: every call does nothing, so callers need no `if tracker`."""

    def log(self, metrics: Metrics, step: int) -> None:
        pass

    def log_summary(self, metrics: Metrics) -> None:
        pass

    def finish(self, timeout: float | None = None) -> None:
        pass


class CompositeTracker(Tracker):
    """Several trackers as one: each call goes to every tracker, in order.

    A tracker whose `log` raises (a tracker written elsewhere; those of this package do not) is
    dropped with one warning and the rest go on. `finish` closes them all at once, so the whole
    call takes at most `timeout`, not one timeout per tracker."""

    def __init__(
        self, trackers: Sequence[Tracker], *, finish_timeout: float = DEFAULT_FINISH_TIMEOUT
    ) -> None:
        self._trackers = list(trackers)
        self.finish_timeout = finish_timeout
        self._lock = threading.Lock()

    @property
    def trackers(self) -> list[Tracker]:
        """The trackers still being written to."""
        return list(self._trackers)

    def log(self, metrics: Metrics, step: int) -> None:
        for tracker in self._trackers:
            try:
                tracker.log(metrics, step)
            except Exception as e:
                self._drop(tracker, e)

    def log_summary(self, metrics: Metrics) -> None:
        for tracker in self._trackers:
            try:
                tracker.log_summary(metrics)
            except Exception as e:
                self._drop(tracker, e)

    def _drop(self, tracker: Tracker, error: Exception) -> None:
        with self._lock:
            if tracker not in self._trackers:
                return
            self._trackers = [t for t in self._trackers if t is not tracker]
        log.warning(
            "tracker %s failed and is off for the rest of the run: %s",
            type(tracker).__name__,
            error,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def finish(self, timeout: float | None = None) -> None:
        timeout = self.finish_timeout if timeout is None else timeout
        trackers, self._trackers = self._trackers, []
        deadline = time.monotonic() + timeout
        threads = [
            threading.Thread(
                target=_finish_quietly, args=(t, timeout), name="tracker-finish", daemon=True
            )
            for t in trackers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _finish_quietly(tracker: Tracker, timeout: float) -> None:
    try:
        tracker.finish(timeout)
    except Exception as e:
        log.warning("tracker %s failed to finish: %s", type(tracker).__name__, e)


def split_values(metrics: Metrics) -> tuple[dict[str, float | int], dict[str, str]]:
    """Numbers and strings apart, as sinks that store them differently need them (TensorBoard
    scalars and text, OpenTelemetry gauges and attributes). A bool is a number (0 or 1);
    anything else is written as its `str`."""
    numbers: dict[str, float | int] = {}
    texts: dict[str, str] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            numbers[key] = int(value)
        elif isinstance(value, int | float):
            numbers[key] = value
        else:
            texts[key] = value if isinstance(value, str) else str(value)
    return numbers, texts


def json_safe(value: MetricValue) -> MetricValue:
    """`value` as strict JSON can hold it: NaN and the infinities become the strings `"NaN"`,
    `"Infinity"` and `"-Infinity"` (which `float()` reads back); other values pass through."""
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    return value
