"""The tmux testnet (upstream's layout): one session `psyche`, the server top left, a monitor
(nvtop, else top) bottom left, the clients stacked in the right column.

Panes are addressed by the ids tmux returns when they are made, so a user's `base-index` or
`pane-base-index` setting changes nothing. Random kills send Ctrl+C to a client's pane and type
the same command (same key) again, as upstream, until the server has exited.

When the run finishes, the clients and then the server exit by themselves and each pane keeps
its process's last lines (the run summary) above a shell prompt; leaving tmux ends the session.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from psyche.cli.local_testnet.commands import TestnetPlan, pick_victims
from psyche.cli.local_testnet.headless import SERVER_START_TIMEOUT, TestnetError, port_in_use

SESSION = "psyche"
# A detached session has no terminal to take its size from; this fits a dozen client panes.
SESSION_SIZE = ("240", "70")


def _default_signals() -> None:
    """In the child, before exec: Ctrl+C and termination act as on a fresh terminal."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


class Tmux:
    def __init__(self, socket_name: str | None = None) -> None:
        self.base = ["tmux"] + (["-L", socket_name] if socket_name else [])

    def run(self, *args: str) -> str:
        # The first command starts the tmux server, whose panes' shells inherit its signal
        # dispositions: a testnet started with SIGINT ignored (a script's `&`, nohup) would give
        # panes where Ctrl+C, and so the random kills, do nothing.
        result = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, preexec_fn=_default_signals
        )
        if result.returncode != 0:
            raise TestnetError(f"tmux {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def new_pane(self, *args: str) -> str:
        return self.run(*args, "-P", "-F", "#{pane_id}").strip()

    def send(self, pane: str, text: str) -> None:
        self.run("send-keys", "-t", pane, text, "C-m")

    def has_session(self, name: str) -> bool:
        return (
            subprocess.run([*self.base, "has-session", "-t", name], capture_output=True).returncode
            == 0
        )


@dataclass(frozen=True)
class Layout:
    server: str
    monitor: str
    clients: tuple[str, ...]


def make_layout(tmux: Tmux, num_clients: int, cwd: Path) -> Layout:
    if tmux.has_session(SESSION):
        raise TestnetError(
            f"a tmux session named {SESSION!r} already exists; end it with "
            f"`tmux kill-session -t {SESSION}`"
        )
    width, height = SESSION_SIZE
    where = ("-c", str(cwd))
    server = tmux.new_pane("new-session", "-d", "-s", SESSION, "-x", width, "-y", height, *where)
    first_client = tmux.new_pane("split-window", "-h", "-t", server, *where)
    monitor = tmux.new_pane("split-window", "-v", "-t", server, *where)
    clients = [first_client]
    for _ in range(num_clients - 1):
        clients.append(tmux.new_pane("split-window", "-v", "-t", clients[-1], *where))
    return Layout(server, monitor, tuple(clients))


def monitor_command() -> str:
    for program in ("nvtop", "top"):
        if shutil.which(program):
            return program
    return "echo 'no monitor found (install nvtop)'"


def wait_for_port(port: int, timeout: float = SERVER_START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not port_in_use(port):
        if time.monotonic() > deadline:
            raise TestnetError(
                f"the server did not listen on port {port} in {timeout} s (see its pane)"
            )
        time.sleep(0.1)


def run_tmux(
    plan: TestnetPlan,
    *,
    socket_name: str | None = None,
    attach: bool = True,
    random_kill_num: int | None = None,
    allowed_to_kill: tuple[int, ...] = (),
    random_kill_interval: float = 120.0,
    cwd: Path | None = None,
    rng: random.Random | None = None,
) -> Layout:
    tmux = Tmux(socket_name)
    cwd = cwd or Path.cwd()
    if port_in_use(plan.server_port):
        raise TestnetError(
            f"port {plan.server_port} (--server-port) is already in use; is another testnet "
            "or psyche-server running?"
        )
    layout = make_layout(tmux, plan.num_clients, cwd)
    try:
        server_cmd = plan.server_command().shell()
        print(f"starting server: {server_cmd}")
        tmux.send(layout.server, server_cmd)
        print("Waiting for server startup...")
        wait_for_port(plan.server_port)
        print("Server started!")
        tmux.send(layout.monitor, monitor_command())
        for number, pane in enumerate(layout.clients, start=1):
            command = plan.client_command(number).shell()
            print(f"starting client {number}: {command}")
            tmux.send(pane, command)
        if not attach:
            return layout
        attached = subprocess.Popen([*tmux.base, "attach-session", "-t", SESSION])
        if random_kill_num:
            rng = rng or random.Random()
            last_kill = time.monotonic()
            numbers = list(range(1, plan.num_clients + 1))
            while attached.poll() is None:
                time.sleep(0.5)
                if not port_in_use(plan.server_port):
                    break  # the server exited (the run finished): nothing to restart into
                if time.monotonic() > last_kill + random_kill_interval:
                    last_kill = time.monotonic()
                    try:
                        for number in pick_victims(numbers, allowed_to_kill, random_kill_num, rng):
                            pane = layout.clients[number - 1]
                            tmux.run("select-pane", "-t", pane)
                            tmux.run("send-keys", "-t", pane, "C-c")
                            tmux.send(pane, plan.client_command(number).shell())
                    except TestnetError:
                        if tmux.has_session(SESSION):
                            raise
                        break  # tmux was ended just as a kill was due: the testnet is over
        attached.wait()
    except BaseException:
        subprocess.run([*tmux.base, "kill-session", "-t", SESSION], capture_output=True)
        raise
    subprocess.run([*tmux.base, "kill-session", "-t", SESSION], capture_output=True)
    return layout


__all__ = ["SESSION", "Layout", "Tmux", "make_layout", "monitor_command", "run_tmux"]
