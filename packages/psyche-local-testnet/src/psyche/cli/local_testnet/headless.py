"""`--headless`: the testnet as child processes of this one, for machines without tmux and CI.

Every line a child prints is echoed prefixed with its name (`[server] ...`, `[client-2] ...`) and,
with `--write-log`, also written to `logs/<start time>/<name>.txt`. Ctrl+C or SIGTERM stops every
child (SIGINT to its process group, SIGKILL after a grace period); so does the server exiting.
Random kills interrupt a client the same way and start the same command (same key) again.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

from psyche.cli.local_testnet.commands import Command, TestnetPlan, pick_victims

STOP_GRACE_SECONDS = 10.0
SERVER_START_TIMEOUT = 120.0


class TestnetError(Exception):
    __test__ = False  # not a pytest test class


@dataclass(eq=False)
class Child:
    name: str
    command: Command
    log_path: Path | None = None
    process: Any = None  # trio.Process
    starts: int = 0
    _log: IO[bytes] | None = field(default=None, repr=False)


class Supervisor:
    def __init__(self, nursery: trio.Nursery, out: IO[str], log_dir: Path | None) -> None:
        self._nursery = nursery
        self._out = out
        self._log_dir = log_dir
        self.children: list[Child] = []

    async def start(self, child: Child) -> None:
        env = child.command.environ(dict(os.environ))
        env["PYTHONUNBUFFERED"] = "1"
        if self._log_dir is not None and child._log is None:
            child.log_path = self._log_dir / f"{child.name}.txt"
            child._log = open(child.log_path, "ab")  # noqa: SIM115 (closed in close())
        child.process = await trio.lowlevel.open_process(
            list(child.command.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        child.starts += 1
        if child not in self.children:
            self.children.append(child)
        self.echo(child.name, f"started (pid {child.process.pid}): {child.command.shell()}")
        self._nursery.start_soon(self._pump, child, child.process)

    def echo(self, name: str, text: str) -> None:
        self._out.write(f"[{name}] {text}\n")
        self._out.flush()

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


async def wait_for_port(port: int, server: Child, timeout: float = SERVER_START_TIMEOUT) -> None:
    with trio.move_on_after(timeout) as scope:
        while True:
            if server.process.returncode is not None:
                raise TestnetError(f"the server exited with code {server.process.returncode}")
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.1)
                continue
            await stream.aclose()
            return
    if scope.cancelled_caught:
        raise TestnetError(f"the server did not accept connections on port {port} in {timeout} s")


async def run_headless(
    plan: TestnetPlan,
    *,
    random_kill_num: int | None = None,
    allowed_to_kill: tuple[int, ...] = (),
    random_kill_interval: float = 120.0,
    log_dir: Path | None = None,
    out: IO[str] | None = None,
    rng: random.Random | None = None,
) -> int:
    """Run the testnet until Ctrl+C/SIGTERM or until the server exits; the server's exit code
    (0 when stopped by a signal)."""
    out = out or sys.stdout
    rng = rng or random.Random()
    exit_code = 0
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(nursery, out, log_dir)
        try:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
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

                async def on_signal(scope: trio.CancelScope) -> None:
                    async for signum in signals:
                        supervisor.echo("testnet", f"got {signal.Signals(signum).name}; stopping")
                        scope.cancel()
                        return

                async def random_kills() -> None:
                    numbers = list(range(1, plan.num_clients + 1))
                    while True:
                        await trio.sleep(random_kill_interval)
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
                    exit_code = await server.process.wait()
                    supervisor.echo("server", f"exited with code {exit_code}")
                    watchers.cancel_scope.cancel()
        except TestnetError as e:
            supervisor.echo("testnet", f"error: {e}")
            exit_code = 1
        finally:
            await supervisor.stop_all()
            nursery.cancel_scope.cancel()
    return exit_code


__all__ = ["Child", "Supervisor", "TestnetError", "run_headless", "wait_for_port"]
