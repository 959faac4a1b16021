"""Helpers of the Solana end-to-end tests: real processes, their logs, and a TCP proxy that can
take an RPC endpoint away and bring it back.

* `Processes`: starts commands with their output in `<dir>/<name>.log`, waits for log lines, and
  at the end interrupts, then kills, every process it started (and its process group).
* `Proxy`: forwards a loopback port to another; `down()` closes the listener and every
  forwarded connection (clients see the endpoint vanish), `up()` listens on the same port again.
* `json_events(text, name)`: the JSON log lines of a `--logs json` client.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


class Processes:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Proc] = []

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> Proc:
        log_path = self.directory / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.started.append(proc)
        return proc

    def wait_for(self, proc: Proc, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(proc.text())
            if match:
                return match
            if proc.popen.poll() is not None:
                match = regex.search(proc.text())
                if match:
                    return match
                raise AssertionError(
                    f"{proc.name} exited ({proc.popen.returncode}) before printing "
                    f"{pattern!r}:\n{proc.text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{proc.name} did not print {pattern!r} in {timeout} s:\n{proc.text()[-4000:]}"
                )
            time.sleep(0.2)

    def stop(self, proc: Proc, grace: float = 10.0) -> int:
        """SIGINT to its process group, SIGKILL after `grace` seconds; the exit code."""
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGINT)
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)  # whatever it left in its group
        return int(proc.popen.returncode)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            self.stop(proc)


def json_events(text: str, name: str | None = None) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if name is None or doc.get("message") == name:
            out.append(doc)
    return out


def wait_event(proc: Proc, name: str, predicate: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for doc in json_events(proc.text(), name):
            if predicate(doc):
                return doc
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{proc.name}: no {name} event as expected in {timeout} s:\n{proc.text()[-4000:]}"
            )
        time.sleep(0.2)


class Proxy:
    """A loopback TCP forwarder whose listening port can go away and come back."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.connections = 0

    def __enter__(self) -> Proxy:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every forwarded connection (both sides see it close)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
