"""A sink that does I/O, kept off the caller's thread: a bounded queue and one worker thread.

`ThreadedTracker` is how every sink of this package runs. On the caller's thread `log` copies
the dictionary and puts it on the queue, a few microseconds whatever the sink is doing. The
worker thread opens the sink (W&B's `init` can take seconds, or fail for want of a network),
writes each entry and closes it at `finish`.

What it guarantees:

* **Never blocks the caller.** A full queue (the sink is slower than the run) drops the entry;
  the first drop is a warning, later ones are counted and reported at most once a minute and
  in total at `finish`.
* **A failing sink is switched off**, with one warning naming it and the error: its `open` or
  a `write` raised. Later calls are ignored at once; the other trackers of a composite go on.
* **`finish` is bounded**: it waits up to `timeout` for the worker to write what was queued and
  close the sink, then returns; a sink still stuck then is abandoned (its thread is a daemon,
  so it does not hold the process either) with a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

from .tracker import DEFAULT_FINISH_TIMEOUT, Metrics, MetricValue, Tracker

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 1024
"""Entries a sink may fall behind by before entries are dropped (at one entry a step, minutes
of a fast run; a few MiB at most)."""

DROP_WARNING_INTERVAL = 60.0
"""Seconds between two warnings about dropped entries of one sink."""

_LOG = 0
_SUMMARY = 1
_STOP = object()


class Sink(Protocol):
    """The I/O half of a tracker. Every method is called on the worker thread only, one at a
    time, so a sink needs no locking; any of them may raise, which switches the sink off."""

    name: str
    """Short name for messages (`wandb`, `tensorboard`, `jsonl`, `otel`)."""

    def open(self) -> None:
        """Connect, create files: whatever may be slow or fail."""

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        """Record one step's values; `timestamp` is when `log` was called (Unix seconds)."""

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        """Record whole-run values."""

    def close(self, timeout: float) -> None:
        """Flush and release, taking at most about `timeout` seconds where the sink can tell."""


class ThreadedTracker(Tracker):
    """One sink behind a bounded queue and a worker thread (see the module's guarantees)."""

    def __init__(
        self,
        sink: Sink,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        drop_warning_interval: float = DROP_WARNING_INTERVAL,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.sink = sink
        # SimpleQueue: put and get are C calls that wake the worker without Python-level
        # locking (queue.Queue's conditions cost the caller several microseconds a call); the
        # bound is kept by `_put` looking at the size first.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.queue_size = queue_size
        self._drop_warning_interval = drop_warning_interval
        self._closed = False
        self._failed = False
        self._close_deadline = 0.0
        self.dropped = 0
        """Entries dropped because the queue was full."""
        self.written = 0
        """Entries the sink has written."""
        self._dropped_reported = 0
        self._last_drop_warning = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"psyche-tracker-{sink.name}", daemon=True
        )
        self._thread.start()

    @property
    def failed(self) -> bool:
        """Whether the sink failed and was switched off."""
        return self._failed

    # ---- the caller's side ---------------------------------------------------------------

    def log(self, metrics: Metrics, step: int) -> None:
        self._put((_LOG, dict(metrics), step, time.time()))

    def log_summary(self, metrics: Metrics) -> None:
        self._put((_SUMMARY, dict(metrics), None, time.time()))

    def _put(self, entry: tuple[Any, ...]) -> None:
        if self._closed or self._failed:
            return
        if self._queue.qsize() >= self.queue_size:
            self._note_drop(entry[2])
            return
        self._queue.put(entry)

    def _note_drop(self, step: int | None) -> None:
        self.dropped += 1
        now = time.monotonic()
        if self.dropped == 1:
            self._last_drop_warning = now
            self._dropped_reported = 1
            log.warning(
                "tracker %s is %d entries behind; dropping what is logged until it catches up "
                "(first dropped: %s)",
                self.sink.name,
                self.queue_size,
                "summary" if step is None else f"step {step}",
            )
        elif now - self._last_drop_warning >= self._drop_warning_interval:
            self._last_drop_warning = now
            log.warning(
                "tracker %s dropped %d more entries (%d in all): it is slower than the run",
                self.sink.name,
                self.dropped - self._dropped_reported,
                self.dropped,
            )
            self._dropped_reported = self.dropped

    def finish(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        timeout = DEFAULT_FINISH_TIMEOUT if timeout is None else timeout
        self._closed = True
        deadline = time.monotonic() + timeout
        self._close_deadline = deadline
        self._queue.put(_STOP)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning(
                "tracker %s did not finish within %.1f s; %d entries left unwritten",
                self.sink.name,
                timeout,
                self._queue.qsize(),
            )
        if self.dropped:
            log.warning(
                "tracker %s dropped %d entries in all (it was slower than the run)",
                self.sink.name,
                self.dropped,
            )

    # ---- the worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        sink = self.sink
        try:
            sink.open()
        except Exception as e:
            self._fail("could not start", e)
            return
        while True:
            entry = self._queue.get()
            if entry is _STOP:
                break
            kind, metrics, step, timestamp = entry
            try:
                if kind == _LOG:
                    sink.write(metrics, step, timestamp)
                else:
                    sink.write_summary(metrics, timestamp)
            except Exception as e:
                self._fail("failed", e)
                self._close_quietly(DEFAULT_FINISH_TIMEOUT)
                return
            self.written += 1
        self._close_quietly(max(0.0, self._close_deadline - time.monotonic()))

    def _fail(self, what: str, error: Exception) -> None:
        self._failed = True
        log.warning(
            "tracker %s %s and is off for the rest of the run: %s",
            self.sink.name,
            what,
            _one_line(error),
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def _close_quietly(self, timeout: float) -> None:
        try:
            self.sink.close(timeout)
        except Exception as e:
            log.warning("tracker %s failed to close: %s", self.sink.name, _one_line(e))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
