"""`psyche.core.cli.interrupt_on_signal`: SIGINT and SIGTERM stop a trio command from its own
task, wherever the signal lands. A signal that lands in a task another library started in
trio's system nursery (py-libp2p's listener and its connection handlers) used to become a
KeyboardInterrupt inside that task, and trio stopped with `TrioInternalError` instead of
running the command's cleanups (a client stopped during a Noise handshake, CI run 32)."""

from __future__ import annotations

import signal

import pytest
import trio

from psyche.core.cli import interrupt_exit_code, interrupt_on_signal, interrupted_by, stop_signals


async def _signal_from_a_system_task(signum: int, cleaned: list[str]) -> None:
    """A system task's child raises `signum` (as a signal landing in its frame would), while
    the main task waits; the main task's cleanup is recorded."""

    async def child() -> None:
        signal.raise_signal(signum)
        await trio.sleep_forever()

    async def system() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)

    trio.lowlevel.spawn_system_task(system)
    try:
        await trio.sleep_forever()
    finally:
        cleaned.append("main")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_a_system_task_stops_the_command_from_its_own_task(signum: int) -> None:
    cleaned: list[str] = []

    async def main() -> None:
        async with interrupt_on_signal():
            await _signal_from_a_system_task(signum, cleaned)

    with stop_signals(), pytest.raises(KeyboardInterrupt):
        trio.run(main)
    assert interrupted_by() == signal.Signals(signum).name
    assert interrupt_exit_code() == 128 + signum
    assert cleaned == ["main"]


def test_without_it_trio_stops_with_an_internal_error() -> None:
    """What the block is for: trio's own delivery raises KeyboardInterrupt in the system
    task's child."""
    cleaned: list[str] = []
    with stop_signals(), pytest.raises(trio.TrioInternalError):
        trio.run(_signal_from_a_system_task, signal.SIGTERM, cleaned)
