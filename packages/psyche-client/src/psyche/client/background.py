"""Work in the background: counted while under way, so whoever started it can wait until none
is left (`Background`), and blocking calls in a thread a cancellation abandons
(`in_abandoned_thread`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_to_thread: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync
"""`trio.to_thread.run_sync` as trio types it: mypy reads trio-stubs (trio-typing's, a libp2p
dependency) before trio's own types, and they predate `abandon_on_cancel`."""


async def in_abandoned_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a worker thread that a cancellation abandons (it finishes on its own and its
    result is dropped): for blocking calls that nothing can interrupt (a wait on processes, a
    model load)."""
    result: T = await _to_thread(fn, abandon_on_cancel=True)
    return result


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
