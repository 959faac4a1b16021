"""Issue test 5: the local testnet with the real client. Headless, both clients train the tiny
model and SIGINT stops the testnet and every process it started (a run to its end, the clients'
identical models and their exits: test_run_finishes.py); in tmux, the panes come up with the
server and the clients running in them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..timing import Deadline
from ..tmux import kill_tmux_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def start_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "psyche.cli.local_testnet", "start", *args]


def test_headless_testnet_trains_and_stops_on_sigint(
    tiny_run: Callable[..., Path], processes: Any, free_port: Callable[[], int]
) -> None:
    config = tiny_run()
    run = processes.start(
        "testnet",
        start_command("--num-clients", "2", "--config-path", str(config), "--headless",
                "--server-port", str(free_port())),
    )  # fmt: skip
    processes.wait_for(run, r"\[server\] .*serving run 'tiny-cpu'", 60)
    for number in (1, 2):
        processes.wait_for(run, rf"\[client-{number}\] .*joined run 'tiny-cpu'", 90)
    processes.wait_for(run, r"\[server\] .*run state: WaitingForMembers -> Warmup", 60)
    for number in (1, 2):  # both train (an epoch to its end: test_run_finishes.py)
        loss = rf"\[client-{number}\] .*: step \d+/\d+ \(epoch 0\): loss \d"
        processes.wait_for(run, loss, 120)
    assert processes.stop(run) == 0
    final = run.text()
    assert "[testnet] got SIGINT; stopping" in final
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)\)", final)]
    assert len(pids) == 3
    for pid in pids:  # every child is gone
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_testnet_panes_come_up(
    tiny_run: Callable[..., Path], free_port: Callable[[], int]
) -> None:
    config = tiny_run()
    socket_name = f"psyche-e2e-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket_name]
    try:
        result = subprocess.run(
            start_command("--num-clients", "2", "--config-path", str(config), "--tui", "false",
                    "--server-port", str(free_port()), "--tmux-socket", socket_name,
                    "--no-attach"),
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        match = re.search(
            r"panes: server (%\d+), monitor (%\d+), clients (%\d+) (%\d+)", result.stdout
        )
        assert match, result.stdout
        server, monitor, *clients = match.groups()

        def capture(pane: str) -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-J", "-t", pane, "-S", "-500"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip

        from psyche.core.identity import SecretKey

        keys = [SecretKey.from_hex(f"{n:064x}").public_key.hex() for n in (1, 2)]
        deadline = Deadline(60)
        while not deadline.expired():  # each client logs its key once it runs
            if all(f"(public key {k})" in capture(p) for p, k in zip(clients, keys)) and (
                "serving run 'tiny-cpu'" in capture(server)  # after its relay is up
            ):
                break
            time.sleep(0.5)
        for number, (pane, key) in enumerate(zip(clients, keys), start=1):
            text = capture(pane)
            assert f"(public key {key}) starting" in text, text
            assert f"RAW_IDENTITY_SECRET_KEY={number:064x}" in text  # the command typed
        assert "serving run 'tiny-cpu'" in capture(server)
        assert capture(monitor).strip()  # nvtop or top is drawing there
        for pane in clients:  # Ctrl+C in a pane stops that client (what random kills do)
            subprocess.run([*tmux, "send-keys", "-t", pane, "C-c"], check=True)
    finally:
        kill_tmux_server(socket_name)
