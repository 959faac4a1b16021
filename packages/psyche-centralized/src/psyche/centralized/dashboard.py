"""The server's terminal dashboard (upstream `server/src/dashboard.rs`), drawn with rich.

It shows upstream's dashboard fields (server address, run id, pause hint, run state, the clients
waiting for the next round, clients and exited clients, round height, checkpoint) plus the step,
the epoch and the data server's numbers, redrawn every 150 ms; log lines scroll above it.
Ctrl+P pauses the run (at the end of the epoch if one is running) or resumes a paused run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import trio

from psyche.coordinator.run_state import RunState

REFRESH_INTERVAL = 0.15
CTRL_P = 0x10


@dataclass(frozen=True)
class DashboardState:
    server_addr: str
    run_id: str
    pending_pause: bool
    run_state: RunState
    nodes_next_round: list[str]
    clients: int
    exited_clients: int
    height: int
    step: int
    epoch: int
    checkpoint: str
    connected: int
    data_server: str | None

    @property
    def pause_hint(self) -> str:
        if self.pending_pause:
            return "Pending pause..."
        if self.run_state is RunState.Paused:
            return "Ctrl + P to resume"
        return "Ctrl + P to pause"


def dashboard_state(server: Any) -> DashboardState:
    """What the dashboard shows of a running `CentralizedServer`."""
    coordinator = server.coordinator
    current = coordinator.current_round()
    llm = coordinator.model.value
    data = None
    if server.data_server is not None:
        served = sum(server.data_server.provided_sequences.values())
        data = (
            f"port {server.data_server.local_addr[1]}: "
            f"{len(server.data_server.connected_clients())} connected, {served} sequences served"
        )
    host, port = server.address
    return DashboardState(
        server_addr=f"{host}:{port}",
        run_id=coordinator.run_id,
        pending_pause=bool(coordinator.pending_pause),
        run_state=coordinator.run_state,
        nodes_next_round=[str(n) for n in server.core.pending_clients],
        clients=len(coordinator.epoch_state.clients),
        exited_clients=len(coordinator.epoch_state.exited_clients),
        height=current.height if current is not None else 0,
        step=coordinator.progress.step,
        epoch=coordinator.progress.epoch,
        checkpoint=str(llm.checkpoint),
        connected=len(server.connected_clients()),
        data_server=data,
    )


def render(state: DashboardState) -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    top = Table.grid(expand=True)
    for _ in range(3):
        top.add_column(ratio=1)
    top.add_row(
        Panel(state.server_addr, title="Server Address"),
        Panel(state.run_id, title="Run ID"),
        Panel(state.pause_hint, title="Pause"),
    )
    info = [
        f"Clients: {state.clients} ({state.exited_clients} exited)",
        f"Height: {state.height}",
        f"Step: {state.step}  Epoch: {state.epoch}",
        f"Checkpoint: {state.checkpoint}",
        f"Connections: {state.connected}",
    ]
    if state.data_server is not None:
        info.append(f"Data server: {state.data_server}")
    left = Group(
        Panel(str(state.run_state), title="Run state"),
        Panel("\n".join(state.nodes_next_round) or "-", title="Clients next round"),
    )
    body = Table.grid(expand=True)
    body.add_column(ratio=1)
    body.add_column(ratio=1)
    body.add_row(left, Panel("\n".join(info), title="Coordinator info"))
    return Group(top, body)


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[bool]:
    """Keys arrive one by one (Ctrl+C still interrupts); restored on exit. Entered before the
    first frame is drawn, and without flushing, so no key typed early is lost."""
    try:
        import termios
        import tty

        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        yield False
        return
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _read_keys(server: Any, fd: int) -> None:
    stream = trio.lowlevel.FdStream(os.dup(fd))
    try:
        while True:
            data = await stream.receive_some(64)
            if not data:
                await trio.sleep_forever()
            if CTRL_P in data:
                server.toggle_pause()
    finally:
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def run_dashboard(server: Any, console: Any) -> None:
    """Draw the dashboard on `console` (a rich Console) until cancelled; Ctrl+P on stdin
    toggles the pause when stdin is a terminal."""
    from rich.live import Live

    fd = sys.stdin.fileno()
    with (
        _cbreak(fd) if sys.stdin.isatty() else contextlib.nullcontext(False) as keys,
        Live(
            render(dashboard_state(server)), console=console, auto_refresh=False, transient=False
        ) as live,
    ):
        async with trio.open_nursery() as nursery:
            if keys:
                nursery.start_soon(_read_keys, server, fd)
            while True:
                live.update(render(dashboard_state(server)), refresh=True)
                await trio.sleep(REFRESH_INTERVAL)


__all__ = ["DashboardState", "dashboard_state", "render", "run_dashboard"]
