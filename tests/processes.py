"""Real processes for the end-to-end tests (tests/e2e, tests/solana): start commands with their
output in `<dir>/<name>.log`, wait for log lines or JSON events, and stop every process a test
started, with its process group.

* `free_port()`: a free TCP port on 127.0.0.1.
* `Processes(directory)`: `start(name, argv, env=...)`, `wait_for(proc, regex, timeout)`,
  `signal(proc, signum)`, `stop(proc)`, `stop_all()`.
* `json_events(text, name)` / `events(proc, name)`: the JSON log lines of a `--logs json`
  process; `wait_event(proc, name, predicate, timeout)`: the first such line that matches;
  `wait_events(proc, name, count, timeout)`: the first `count` lines of that name.

Every `timeout` is in seconds on an idle two-core machine, stretched to this one's measured
speed when it runs out (`tests/timing.py`'s `Deadline`). The clients started here train on one
thread (`CPU_THREADS=1`, the client's `--cpu-threads`), as several share the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .timing import Deadline

REPO = Path(__file__).resolve().parents[1]


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

    def story(self, tail: int = 4000) -> str:
        """What a failed wait prints: the process's warnings, errors and state changes (at most
        the last 40; a CI log keeps only this, so the cause must be in it, not just the end of
        the output) and then the last `tail` characters of its output."""
        text = self.text()
        notable = [
            line
            for line in text.splitlines()
            if '"level": "WARNING"' in line
            or '"level": "ERROR"' in line
            or '"message": "state_change"' in line
            or "Traceback" in line
        ]
        head = "\n".join(line[:400] for line in notable[-40:])
        return f"-- warnings, errors, state changes:\n{head}\n-- the output's end:\n{text[-tail:]}"

    @property
    def pid(self) -> int:
        return self.popen.pid


class Processes:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Proc] = []

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO
    ) -> Proc:
        log_path = self.directory / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "CPU_THREADS": "1", **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.started.append(proc)
        return proc

    def wait_for(
        self, proc: Proc, pattern: str, timeout: float, *, after: int = 0
    ) -> re.Match[str]:
        """The first match of `pattern` in `proc`'s output past character `after`."""
        regex = re.compile(pattern)
        deadline = Deadline(timeout)
        while True:
            match = regex.search(proc.text(), after)
            if match:
                return match
            if proc.popen.poll() is not None:
                match = regex.search(proc.text(), after)
                if match:
                    return match
                raise AssertionError(
                    f"{proc.name} exited ({proc.popen.returncode}) before printing "
                    f"{pattern!r}:\n{proc.story()}"
                )
            if deadline.expired():
                raise AssertionError(
                    f"{proc.name} did not print {pattern!r} in {deadline}:\n{proc.story()}"
                )
            time.sleep(0.2)

    def signal(self, proc: Proc, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    def stop(self, proc: Proc, grace: float = 15.0) -> int:
        """SIGINT to its process group, SIGKILL after `grace` seconds; the exit code."""
        if proc.popen.poll() is None:
            self.signal(proc, signal.SIGINT)
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(proc, signal.SIGKILL)
                proc.popen.wait()
        self.signal(proc, signal.SIGKILL)  # whatever it left in its group
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


def events(proc: Proc, name: str | None = None) -> list[dict[str, Any]]:
    return json_events(proc.text(), name)


def wait_event(
    proc: Proc, name: str, predicate: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    deadline = Deadline(timeout)
    while True:
        for doc in events(proc, name):
            if predicate(doc):
                return doc
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.story()}")
        if deadline.expired():
            raise AssertionError(
                f"{proc.name}: no {name} event as expected in {deadline}:\n{proc.story()}"
            )
        time.sleep(0.2)


def wait_events(proc: Proc, name: str, count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = Deadline(timeout)
    while True:
        found = events(proc, name)
        if len(found) >= count:
            return found[:count]
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.story()}")
        if deadline.expired():
            raise AssertionError(
                f"{proc.name}: {len(found)} {name} events of {count} in {deadline}:\n{proc.story()}"
            )
        time.sleep(0.2)
