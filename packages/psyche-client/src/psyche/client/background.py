"""Background tasks that are counted, so whoever started them can wait until none is running."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


class Background:
    """Tasks started on a nursery, counted: `wait_idle` returns once none of them is running.

    The state machine starts its work this way (a round's training step, payload checks, the
    cooldown) and the cooldown its checkpoint writes, so the end of the run can wait for the
    writes and a simulation can let work take no simulated time.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._running = 0
        self._idle = trio.Event()
        self._idle.set()

    @property
    def running(self) -> int:
        return self._running

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._running == 0:
            self._idle = trio.Event()
        self._running += 1
        self._nursery.start_soon(self._run, fn, args, name=fn)

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no task started here is running (at once when none is)."""
        await self._idle.wait()
