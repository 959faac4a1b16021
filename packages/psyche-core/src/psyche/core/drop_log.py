"""A log that peers cannot flood: what a remote peer makes a node do, at most a few lines a kind.

Every line a remote peer can cause (a refused or dropped connection, an ignored or rejected
message, a join) goes through a `DropLog`: the coordinator's rules (`ServerCore`), the TCP and
blob servers of `psyche.transport` and `psyche.network`, the data server and the status page.
It sits here, below them all, because the coordinator's rules log through it too and know
nothing of sockets.
"""

from __future__ import annotations

import logging
from collections import Counter

import trio


class DropLog:
    """Logs what peers make a server do (refused and dropped connections, ignored messages,
    joins) without letting a flood flood the log: every line a remote peer can cause goes
    through one.

    The first `burst` events of each kind in an interval are logged with their detail; the rest
    are counted and reported in one line when the interval ends (`run` must be running for
    that). So a kind costs at most `burst` + 1 lines per interval, however many peers cause it."""

    def __init__(
        self, logger: logging.Logger, what: str, interval: float = 10.0, *, burst: int = 1
    ) -> None:
        self._logger = logger
        self._what = what
        self.interval = interval
        self.burst = burst
        self.counts: Counter[str] = Counter()
        """Every event so far, by kind (for tests and figures)."""
        self._suppressed: Counter[str] = Counter()
        self._seen: Counter[str] = Counter()
        self._started = trio.Event()

    def note(self, kind: str, detail: str, level: int = logging.WARNING) -> None:
        self.counts[kind] += 1
        if self._seen[kind] >= self.burst:
            self._suppressed[kind] += 1
            return
        self._seen[kind] += 1
        self._logger.log(level, "%s", detail)
        self._started.set()

    async def run(self) -> None:
        while True:
            await self._started.wait()
            await trio.sleep(self.interval)
            self.flush()

    def flush(self) -> None:
        if self._suppressed:
            summary = ", ".join(f"{n} {kind}" for kind, n in sorted(self._suppressed.items()))
            self._logger.warning(
                "%s in the last %.0f s besides those above: %s", self._what, self.interval, summary
            )
        self._suppressed.clear()
        self._seen.clear()
        self._started = trio.Event()
