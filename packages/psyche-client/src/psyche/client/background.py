"""Work that is counted while under way, so whoever started it can wait until none is left."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


class InFlight:
    """A count of things under way and an event for the moment it drops to zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    def begin(self) -> None:
        if self.count == 0:
            self._idle = trio.Event()
        self.count += 1

    def end(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once nothing is under way (at once when nothing is)."""
        await self._idle.wait()


class Background:
    """Tasks started on a nursery, counted: `wait_idle` returns once none of them is running.

    The state machine starts its work this way (a round's training step, payload checks, the
    cooldown) and the cooldown its checkpoint writes, so the end of the run can wait for the
    writes and a simulation can let work take no simulated time.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._in_flight = InFlight()

    @property
    def running(self) -> int:
        return self._in_flight.count

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._in_flight.begin()
        self._nursery.start_soon(self._run, fn, args, name=fn)

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        finally:
            self._in_flight.end()

    async def wait_idle(self) -> None:
        """Return once no task started here is running (at once when none is)."""
        await self._in_flight.wait_idle()
