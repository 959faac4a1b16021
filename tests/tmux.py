"""What the tests that start the local testnet in tmux share (tests/local_testnet with a
stand-in client, tests/e2e with the real one): each runs its own tmux server on a socket of its
own (`tmux -L NAME`), never the user's, and ends it afterwards."""

from __future__ import annotations

import subprocess
from pathlib import Path


def kill_tmux_server(socket_name: str) -> None:
    """End the test's tmux server and remove its socket file (tmux leaves it behind)."""
    found = subprocess.run(
        ["tmux", "-L", socket_name, "display-message", "-p", "#{socket_path}"],
        capture_output=True,
        text=True,
    )
    subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True)
    if found.returncode == 0 and found.stdout.strip():
        Path(found.stdout.strip()).unlink(missing_ok=True)
