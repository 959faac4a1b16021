from __future__ import annotations

import threading
import time

import pytest
import trio

from psyche.core.cancellable_barrier import (
    BarrierState,
    CancellableBarrier,
    CancelledBarrier,
    TrioCancellableBarrier,
)

JOIN_TIMEOUT = 5.0


def run_threads(*targets: object) -> list[object]:
    """Run callables in threads; each result is its return value or the exception it raised."""
    results: list[object] = [None] * len(targets)

    def wrap(i: int, fn: object) -> None:
        try:
            results[i] = fn()  # type: ignore[operator]
        except Exception as e:
            results[i] = e

    threads = [
        threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
        assert not t.is_alive(), "barrier deadlocked"
    return results


def test_basic_barrier() -> None:
    barrier = CancellableBarrier(3)
    assert run_threads(barrier.wait, barrier.wait, barrier.wait) == [None, None, None]


def test_cancel_barrier() -> None:
    barrier = CancellableBarrier(3)

    def late() -> None:
        time.sleep(0.1)
        barrier.wait()

    def canceller() -> None:
        barrier.cancel()
        barrier.wait()

    results = run_threads(late, late, canceller)
    assert all(isinstance(r, CancelledBarrier) for r in results)
    assert barrier.is_cancelled()


def test_cancel_wakes_waiters() -> None:
    barrier = CancellableBarrier(3)

    def cancel_later() -> None:
        # Cancel only once both are waiting: a cancel seen on arrival would wake nobody.
        deadline = time.monotonic() + JOIN_TIMEOUT
        while barrier._state.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert barrier._state.count == 2
        barrier.cancel()

    results = run_threads(barrier.wait, barrier.wait, cancel_later)
    assert isinstance(results[0], CancelledBarrier)
    assert isinstance(results[1], CancelledBarrier)


def test_reset_barrier() -> None:
    barrier = CancellableBarrier(2)
    barrier.cancel()
    with pytest.raises(CancelledBarrier):
        barrier.wait()
    barrier.reset()
    assert not barrier.is_cancelled()
    assert run_threads(barrier.wait, barrier.wait) == [None, None]


def test_barrier_is_reusable() -> None:
    barrier = CancellableBarrier(2)

    def three_rounds() -> int:
        for _ in range(3):
            barrier.wait()
        return 3

    assert run_threads(three_rounds, three_rounds) == [3, 3]


def test_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="Barrier size must be greater than 0"):
        CancellableBarrier(0)
    with pytest.raises(ValueError, match="Barrier size must be greater than 0"):
        TrioCancellableBarrier(0)


def test_state_machine() -> None:
    state = BarrierState(2)
    generation = state.arrive()
    assert generation == 0
    assert state.must_wait(0)
    assert state.arrive() is None  # the second arrival completes generation 0
    assert not state.must_wait(0)
    state.cancel()
    with pytest.raises(CancelledBarrier):
        state.arrive()
    state.reset()
    assert (state.count, state.generation, state.cancelled) == (0, 2, False)


def test_trio_barrier() -> None:
    async def main() -> list[str]:
        barrier = TrioCancellableBarrier(3)
        passed: list[str] = []

        async def party(name: str, delay: float) -> None:
            await trio.sleep(delay)
            await barrier.wait()
            passed.append(name)

        with trio.fail_after(JOIN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(party, str(i), 0.01 * i)
        return passed

    assert sorted(trio.run(main)) == ["0", "1", "2"]


def test_trio_cancel_and_reset() -> None:
    async def main() -> None:
        barrier = TrioCancellableBarrier(2)
        outcomes: list[str] = []

        async def waiter() -> None:
            try:
                await barrier.wait()
                outcomes.append("passed")
            except CancelledBarrier:
                outcomes.append("cancelled")

        with trio.fail_after(JOIN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.01)
                barrier.cancel()
        assert outcomes == ["cancelled"]
        with pytest.raises(CancelledBarrier):
            await barrier.wait()
        barrier.reset()
        with trio.fail_after(JOIN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                nursery.start_soon(waiter)
        assert outcomes == ["cancelled", "passed", "passed"]

    trio.run(main)


def test_trio_waiter_that_gives_up_is_not_counted() -> None:
    async def main() -> None:
        barrier = TrioCancellableBarrier(2)
        with trio.move_on_after(0.01):
            await barrier.wait()  # nobody else comes; this task gives up
        # Were it still counted, a single arrival would now pass alone.
        with trio.move_on_after(0.05) as scope:
            await barrier.wait()
        assert scope.cancelled_caught
        with trio.fail_after(JOIN_TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(barrier.wait)
                nursery.start_soon(barrier.wait)

    trio.run(main)
