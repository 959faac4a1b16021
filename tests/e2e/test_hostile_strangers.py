"""Issue 13, memory before login: floods of strangers against a real `psyche-server run` (its
coordinator and data ports) and a real client's blob side channel, while two honest clients
train the tiny CPU model.

Each flood is 100 connections that claim 8 MiB frames (before login; on the coordinator also
after logging in with fresh keys; on the blob port also silent ones), held for two seconds
(`HOLD`, stretched on a slower machine) and closed. The old transport allocated every claimed
frame (+840 MB per flood, kept after login); now the listener's VmRSS (from /proc) must stay
within `BOUND` of a quiet window measured just before, at its peak and after the sockets close,
every pre-login claim must be refused at once, and the honest clients must go on training and
end the epoch with identical models.

The floods are `scripts/chaos/flood.py`'s, which prints the same figures for docs/reliability.md.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from ..processes import REPO, Processes, events, free_port, wait_event
from ..timing import scaled

sys.path.insert(0, str(REPO / "scripts" / "chaos"))
import flood

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MB = 1_000_000
BOUND = 50 * MB
CONNECTIONS = 100
HOLD = 2.0
"""Each flood's (and quiet window's) seconds on the tuning machine, stretched to this one's speed
(`tests/timing.py`): a starved listener closes a pre-login claim at once, but not within 2 s at
load 18 (99 of 100 were, with the fixed hold)."""
CONFIG = {"epoch_time": 40, "init_min_clients": 2, "min_clients": 2}
"""Epoch 0 holds the floods (ten windows of `HOLD` + 1 s) after its first applied round where it
can, and the test waits for its end; where they outlast it, the training after them is epoch 1's,
and epoch 0's cooldown models were already out: either way no longer epoch is waited out."""


def client_command(port: int) -> list[str]:
    return [
        sys.executable, str(flood.LAUNCH), "client", "train", "--run-id", "tiny-cpu",
        "--server-addr", f"127.0.0.1:{port}", "--logs", "json", "--device", "cpu",
        "--bind-p2p-interface", "lo", "--server-reconnect-timeout", "0",
    ]  # fmt: skip


def last_applied(proc: Any) -> int:
    steps = [e["step"] for e in events(proc, "applied_results")]
    return max(steps, default=-1)


def test_floods_leave_memory_bounded_and_the_run_training(
    tiny_run: Callable[..., Path], processes: Processes
) -> None:
    run = tiny_run(**CONFIG)
    data_port = int(re.search(r"127\.0\.0\.1:(\d+)", (run / "state.toml").read_text()).group(1))
    ports = {"coordinator": free_port(), "data": data_port, "blob": free_port()}
    server = processes.start(
        "server",
        [sys.executable, "-m", "psyche.cli.server", "run",
         "--state", str(run / "state.toml"), "--data-config", str(run / "data.toml"),
         "--server-port", str(ports["coordinator"]), "--tui", "false"],
    )  # fmt: skip
    processes.wait_for(server, r"serving run 'tiny-cpu'", 60)
    clients = {}
    for number in (1, 2):
        env = {"RAW_IDENTITY_SECRET_KEY": f"{number:064x}", "OMP_NUM_THREADS": "1"}
        if number == 2:
            env["CHAOS_BLOB_PORT"] = str(ports["blob"])  # the flooded blob port is client 2's
        clients[number] = processes.start(
            f"client-{number}", client_command(ports["coordinator"]), env=env
        )
    for proc in clients.values():
        wait_event(proc, "applied_results", lambda e: True, 180)

    hold = scaled(HOLD)
    rows = trio.run(flood.attacks, server.pid, clients[2].pid, ports, CONNECTIONS, hold, 1.0)
    report = flood.table(rows, CONNECTIONS)
    print(report)
    for name, quiet, window, attack in rows:
        assert attack.opened == CONNECTIONS, (name, report)
        assert window.peak_growth - max(quiet.peak_growth, 0) < BOUND, (name, report)
        assert window.growth - max(quiet.growth, 0) < BOUND, (name, report)
        if "before login" in name or "claims" in name:
            assert attack.closed_by_peer == CONNECTIONS, (name, report)  # refused at once

    # Training went on through the floods, and goes on after them.
    after = max(last_applied(proc) for proc in clients.values())
    for proc in clients.values():
        wait_event(proc, "applied_results", lambda e, after=after: e["step"] >= after + 2, 120)
    hashes = [
        wait_event(proc, "cooldown_model", lambda e: e["epoch"] == 0, 180)["model_hash"]
        for proc in clients.values()
    ]
    assert hashes[0] == hashes[1]
    assert all(proc.popen.poll() is None for proc in (server, *clients.values()))
    assert "Traceback" not in server.text()
