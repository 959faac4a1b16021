"""A barrier for N parties that can be cancelled (tensor-parallel workers abandoning a step).

`BarrierState` is the state machine, shared by the two flavours:

* `CancellableBarrier` blocks threads (upstream's, on a condition variable);
* `TrioCancellableBarrier` suspends tasks of one trio run.

`wait` raises `CancelledBarrier` when the barrier is, or becomes, cancelled while waiting;
`reset` clears the cancellation and starts a new generation without waking anyone (as upstream).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio


class CancelledBarrier(Exception):
    """The barrier was cancelled before (or while) this party waited on it."""


@dataclass
class BarrierState:
    total: int
    count: int = 0
    generation: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError("Barrier size must be greater than 0")

    def arrive(self) -> int | None:
        """Count one arrival: the generation to wait on, or None when this arrival completes it
        (the caller then wakes every waiter)."""
        if self.cancelled:
            raise CancelledBarrier
        generation = self.generation
        self.count += 1
        if self.count < self.total:
            return generation
        self.count = 0
        self.generation += 1
        return None

    def must_wait(self, generation: int) -> bool:
        return self.count < self.total and self.generation == generation and not self.cancelled

    def after_wait(self) -> None:
        if self.cancelled:
            raise CancelledBarrier

    def leave(self, generation: int) -> None:
        """Withdraw an arrival whose waiter gave up (trio cancellation) before its generation
        completed; threads cannot give up, so upstream has no such step."""
        if self.generation == generation and self.count > 0:
            self.count -= 1

    def cancel(self) -> None:
        self.cancelled = True

    def reset(self) -> None:
        self.cancelled = False
        self.count = 0
        self.generation += 1


class Barrier(Protocol):
    def wait(self) -> None: ...
    def cancel(self) -> None: ...
    def reset(self) -> None: ...
    def is_cancelled(self) -> bool: ...


class CancellableBarrier:
    """For threads."""

    __slots__ = ("_condition", "_state")

    def __init__(self, n: int) -> None:
        self._state = BarrierState(n)
        self._condition = threading.Condition()

    def wait(self) -> None:
        with self._condition:
            generation = self._state.arrive()
            if generation is None:
                self._condition.notify_all()
                return
            while self._state.must_wait(generation):
                self._condition.wait()
            self._state.after_wait()

    def cancel(self) -> None:
        with self._condition:
            self._state.cancel()
            self._condition.notify_all()

    def reset(self) -> None:
        with self._condition:
            self._state.reset()

    def is_cancelled(self) -> bool:
        with self._condition:
            return self._state.cancelled


class TrioCancellableBarrier:
    """For tasks of one trio run (not thread-safe: trio tasks share one thread)."""

    __slots__ = ("_state", "_wakeup")

    def __init__(self, n: int) -> None:
        import trio

        self._state = BarrierState(n)
        self._wakeup: trio.Event = trio.Event()

    def _notify_all(self) -> None:
        import trio

        self._wakeup.set()
        self._wakeup = trio.Event()

    async def wait(self) -> None:
        import trio

        generation = self._state.arrive()
        if generation is None:
            self._notify_all()
            # yield to the woken tasks, but never fail a wait that has already completed
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        try:
            while self._state.must_wait(generation):
                await self._wakeup.wait()
        except trio.Cancelled:
            self._state.leave(generation)
            raise
        self._state.after_wait()

    def cancel(self) -> None:
        self._state.cancel()
        self._notify_all()

    def reset(self) -> None:
        self._state.reset()

    def is_cancelled(self) -> bool:
        return self._state.cancelled
