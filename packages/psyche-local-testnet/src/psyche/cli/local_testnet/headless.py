"""`--headless`: the testnet as child processes of this one, for machines without tmux and CI.

Every line a child prints is echoed prefixed with its name (`[server] ...`, `[client-2] ...`) and,
with `--write-log`, also written to `logs/<start time>/<name>.txt`. Random kills interrupt a
client the same way and start the same command (same key) again.

The testnet ends by itself when the run does: the clients exit once the coordinator reaches
`Finished` and the server once they have left. When the server (or every client) has exited,
the others get `exit_grace` seconds to exit on their own and are stopped after that; a server
that failed, or clients that all exited with one failing, end the testnet at once. The exit code
is 0 when every process exited 0 by itself, else 1, and the last line names who failed.
Ctrl+C or SIGTERM stops every child (SIGINT to its process group, SIGKILL after a grace period)
and exits 0.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from psyche.cli.local_testnet.commands import Command, TestnetPlan, pick_victims
from psyche.core.cli import short_duration

STOP_GRACE_SECONDS = 10.0
SERVER_START_TIMEOUT = 120.0
# How long the rest may take to exit by themselves once the server (or every client) has.
EXIT_GRACE_SECONDS = 30.0


class TestnetError(Exception):
    __test__ = False  # not a pytest test class


@dataclass(eq=False)
class Child:
    name: str
    command: Command
    log_path: Path | None = None
    process: Any = None  # trio.Process
    starts: int = 0
    # The exit code of its latest process when that process ended by itself (not stopped by us).
    exit_code: int | None = None
    stopping: bool = False
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    def __init__(self, nursery: trio.Nursery, out: IO[str], log_dir: Path | None) -> None:
        self._nursery = nursery
        self._out = out
        self._log_dir = log_dir
        self.children: list[Child] = []
        self._changed = trio.Event()

    async def start(self, child: Child) -> None:
        env = child.command.environ(dict(os.environ))
        env["PYTHONUNBUFFERED"] = "1"
        if self._log_dir is not None and child._log is None:
            child.log_path = self._log_dir / f"{child.name}.txt"
            child._log = open(child.log_path, "ab")  # noqa: SIM115, ASYNC230 (closed in close(); a local log)
        child.process = await trio.lowlevel.open_process(
            list(child.command.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        child.starts += 1
        child.exit_code = None
        child.stopping = False
        if child not in self.children:
            self.children.append(child)
        self.echo(child.name, f"started (pid {child.process.pid}): {child.command.shell()}")
        self._nursery.start_soon(self._pump, child, child.process)
        self._nursery.start_soon(self._watch, child, child.process)

    def echo(self, name: str, text: str) -> None:
        self._out.write(f"[{name}] {text}\n")
        self._out.flush()

    async def wait_for_change(self) -> None:
        """Until a child's process next ends by itself."""
        await self._changed.wait()

    async def _watch(self, child: Child, process: Any) -> None:
        code = await process.wait()
        if child.process is process and not child.stopping:
            child.exit_code = int(code)
            self.echo(child.name, f"exited with code {code}")
            self._changed.set()
            self._changed = trio.Event()

    async def _pump(self, child: Child, process: Any) -> None:
        pending = b""
        async with process.stdout:
            while True:
                try:
                    chunk = await process.stdout.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not chunk:
                    break
                if child._log is not None:
                    child._log.write(chunk)
                    child._log.flush()
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self.echo(child.name, line.decode("utf-8", errors="replace").rstrip("\r"))
        if pending:
            self.echo(child.name, pending.decode("utf-8", errors="replace"))

    async def stop(self, child: Child, *, grace: float = STOP_GRACE_SECONDS) -> int | None:
        """Interrupt `child` (its whole process group), kill it after `grace` seconds."""
        process = child.process
        if process is None:
            return None
        if process.returncode is None:
            child.stopping = True
            _signal_group(process.pid, signal.SIGINT)
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                self.echo(child.name, f"did not stop within {grace:.0f} s; killing it")
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        else:
            _signal_group(process.pid, signal.SIGKILL)  # leftovers of its group
        return int(process.returncode)

    async def stop_all(self) -> None:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for child in reversed(self.children):
                    nursery.start_soon(self.stop, child)
        for child in self.children:
            if child._log is not None:
                child._log.close()
                child._log = None


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """Whether something listens on (or holds) `port`: a bind there fails. Checking this way
    sends the server nothing, where a test connection would be an unauthenticated peer it
    logs."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


async def wait_for_port(port: int, server: Child, timeout: float = SERVER_START_TIMEOUT) -> None:
    with trio.move_on_after(timeout) as scope:
        while True:
            if server.process.returncode is not None:
                raise TestnetError(f"the server exited with code {server.process.returncode}")
            if port_in_use(port):
                return
            await trio.sleep(0.1)
    if scope.cancelled_caught:
        raise TestnetError(f"the server did not listen on port {port} in {timeout} s")


async def _wait_for_the_end(
    supervisor: Supervisor, server: Child, clients: list[Child], grace: float
) -> None:
    """Until the run has ended by itself: the server or every client exited, then the rest
    within `grace` seconds (not waited for when that cannot end well)."""
    while server.exit_code is None and not all(c.exit_code is not None for c in clients):
        await supervisor.wait_for_change()
    if server.exit_code not in (None, 0):
        supervisor.echo("testnet", "the server failed; stopping the clients")
        return
    if server.exit_code is None and any(c.exit_code != 0 for c in clients):
        supervisor.echo("testnet", "every client has exited, not all of them cleanly; stopping")
        return
    with trio.move_on_after(grace):
        while any(c.exit_code is None for c in (server, *clients)):
            await supervisor.wait_for_change()


def _outcome(
    supervisor: Supervisor, plan: TestnetPlan, children: list[Child], seconds: float
) -> int:
    """The last line (who failed, or where the model is) and the exit code."""
    failed = []
    for child in children:
        if child.exit_code is None:
            failed.append(f"{child.name} was stopped (it had not exited by itself)")
        elif child.exit_code != 0:
            failed.append(f"{child.name} exited with code {child.exit_code}")
    if failed:
        supervisor.echo("testnet", f"the run did not end cleanly: {'; '.join(failed)}")
        return 1
    clients = len(children) - 1
    line = f"done in {short_duration(seconds)}: the server and {clients} clients exited 0"
    if plan.checkpoint_dir is not None:
        line += f"; client-1 saved the model under {plan.checkpoint_dir.absolute()}"
    supervisor.echo("testnet", line)
    return 0


async def run_headless(
    plan: TestnetPlan,
    *,
    random_kill_num: int | None = None,
    allowed_to_kill: tuple[int, ...] = (),
    random_kill_interval: float = 120.0,
    log_dir: Path | None = None,
    out: IO[str] | None = None,
    rng: random.Random | None = None,
    exit_grace: float = EXIT_GRACE_SECONDS,
) -> int:
    """Run the testnet until the run ends by itself (0 when every process exited 0, else 1)
    or until Ctrl+C/SIGTERM (0)."""
    out = out or sys.stdout
    rng = rng or random.Random()
    exit_code = 0
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(nursery, out, log_dir)
        try:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if port_in_use(plan.server_port):
                    raise TestnetError(
                        f"port {plan.server_port} (--server-port) is already in use; is another "
                        "testnet or psyche-server running?"
                    )
                server = Child("server", plan.server_command())
                await supervisor.start(server)
                supervisor.echo("testnet", f"waiting for the server on port {plan.server_port}")
                await wait_for_port(plan.server_port, server)
                clients = [
                    Child(f"client-{i}", plan.client_command(i))
                    for i in range(1, plan.num_clients + 1)
                ]
                for client in clients:
                    await supervisor.start(client)
                interrupted = False

                async def on_signal(scope: trio.CancelScope) -> None:
                    nonlocal interrupted
                    async for signum in signals:
                        supervisor.echo("testnet", f"got {signal.Signals(signum).name}; stopping")
                        interrupted = True
                        scope.cancel()
                        return

                async def random_kills() -> None:
                    numbers = list(range(1, plan.num_clients + 1))
                    while True:
                        await trio.sleep(random_kill_interval)
                        if any(c.exit_code is not None for c in supervisor.children):
                            return  # the run is ending: nothing to restart into
                        for number in pick_victims(
                            numbers, allowed_to_kill, random_kill_num or 0, rng
                        ):
                            victim = clients[number - 1]
                            supervisor.echo("testnet", f"random kill: restarting {victim.name}")
                            await supervisor.stop(victim)
                            await supervisor.start(victim)

                async with trio.open_nursery() as watchers:
                    watchers.start_soon(on_signal, watchers.cancel_scope)
                    if random_kill_num:
                        watchers.start_soon(random_kills)
                    await _wait_for_the_end(supervisor, server, clients, exit_grace)
                    watchers.cancel_scope.cancel()
                await supervisor.stop_all()
                if not interrupted:
                    exit_code = _outcome(
                        supervisor,
                        plan,
                        [server, *clients],
                        time.monotonic() - started,
                    )
        except TestnetError as e:
            supervisor.echo("testnet", f"error: {e}")
            exit_code = 1
        finally:
            await supervisor.stop_all()
            nursery.cancel_scope.cancel()
    return exit_code


__all__ = [
    "EXIT_GRACE_SECONDS",
    "Child",
    "Supervisor",
    "TestnetError",
    "port_in_use",
    "run_headless",
    "wait_for_port",
]
