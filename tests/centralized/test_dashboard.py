"""The server dashboard: upstream's fields, and Ctrl+P pausing a real server in a terminal."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from psyche.centralized.dashboard import DashboardState, render
from psyche.coordinator import RunState

REPO = Path(__file__).resolve().parents[2]


def text_of(state: DashboardState) -> str:
    console = Console(width=180, record=True, color_system=None)
    console.print(render(state))
    return console.export_text()


def test_render_shows_upstreams_fields() -> None:
    state = DashboardState(
        server_addr="0.0.0.0:20000",
        run_id="tiny-cpu",
        pending_pause=False,
        run_state=RunState.RoundTrain,
        nodes_next_round=["4cb5abf6", "7422b988"],
        clients=3,
        exited_clients=1,
        height=7,
        step=12,
        epoch=1,
        checkpoint="P2P - Hub repo: configs/tiny-cpu/model",
        connected=4,
        data_server="port 20001: 3 connected, 96 sequences served",
    )
    text = text_of(state)
    for expected in (
        "0.0.0.0:20000",
        "tiny-cpu",
        "Ctrl + P to pause",
        "Training",
        "4cb5abf6",
        "Clients: 3 (1 exited)",
        "Height: 7",
        "Checkpoint: P2P - Hub repo: configs/tiny-cpu/model",
        "96 sequences served",
    ):
        assert expected in text
    paused = DashboardState(**{**state.__dict__, "run_state": RunState.Paused})
    assert "Ctrl + P to resume" in text_of(paused)
    pending = DashboardState(**{**state.__dict__, "pending_pause": True})
    assert "Pending pause..." in text_of(pending)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a Linux pty")
def test_ctrl_p_pauses_and_resumes_a_running_server(tmp_path: Path) -> None:
    import pty

    state = (REPO / "configs/tiny-cpu/state.toml").read_text()
    state = state.replace(
        'data_location = { Server = "127.0.0.1:20001" }', 'data_location = "Dummy"'
    )
    (tmp_path / "state.toml").write_text(state)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a server drawing its dashboard on the pty
        os.chdir(REPO)
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "psyche.cli.server",
                "run",
                "--state",
                str(tmp_path / "state.toml"),
            ],
        )
    seen = bytearray()

    def read_until(needle: bytes, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in seen:
                return True
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    seen.extend(os.read(fd, 65536))
                except OSError:
                    return needle in seen
        return needle in seen

    try:
        assert read_until(b"Ctrl + P to pause"), seen.decode(errors="replace")[-2000:]
        assert read_until(b"Waiting for members")
        os.write(fd, b"\x10")  # Ctrl+P: no epoch is running, so the run pauses at once
        assert read_until(b"Ctrl + P to resume"), seen.decode(errors="replace")[-2000:]
        del seen[:]
        os.write(fd, b"\x10")
        assert read_until(b"Ctrl + P to pause")
        assert read_until(b"Waiting for members")
    finally:
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            read_until(b"\x00", 0.1)  # keep draining the pty
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert status == 0
