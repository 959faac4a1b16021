"""Shared fixtures of the command tests: real processes, started as a background job of a script
would be (SIGINT ignored), with their output in `tmp_path/<name>.log`.

* `processes` fixture -> `tests/processes.Processes` (stops whatever a test started).
* `start_detached(processes, name, argv, env=...)`: start a command in its own session with SIGINT
  ignored, as `cmd &` in a non-interactive shell or `nohup cmd` does; `start_client` starts
  `psyche-client train` so.
* `dummy_run(tmp_path)`: a run directory whose `state.toml` needs no model or data (a Dummy
  run), for the server and the testnet launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..processes import REPO, Proc, Processes
from .support import dummy_state

BIN = Path(sys.executable).parent

DUMMY_STATE = dummy_state("cli-test")


def command(name: str) -> str:
    """A console script installed beside this interpreter (`psyche-client`, ...)."""
    path = BIN / name
    assert path.is_file(), f"{name} is not installed in {BIN}"
    return str(path)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_detached(
    processes: Processes,
    name: str,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> Proc:
    """`argv` in its own session with SIGINT ignored, output in `<dir>/<name>.log`."""
    log_path = processes.directory / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ignore_sigint,
        )
    proc = Proc(name, popen, log_path)
    processes.started.append(proc)
    return proc


KEY_1 = f"{1:064x}"


def start_client(processes: Processes, server_addr: str, *flags: str, run_id: str = "r") -> Proc:
    """`psyche-client train` on `server_addr` with console logs and the identity key 1, started
    as `start_detached` starts it (named `client`)."""
    return start_detached(
        processes,
        "client",
        [command("psyche-client"), "train", "--run-id", run_id, "--server-addr", server_addr,
         "--logs", "console", *flags],
        env={"RAW_IDENTITY_SECRET_KEY": KEY_1},
    )  # fmt: skip


def exit_code(proc: Proc, timeout: float) -> int:
    """`proc`'s exit code once it ends by itself within `timeout` seconds (no signal is sent)."""
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{proc.name} still running after {timeout} s:\n{proc.text()[-4000:]}"
        ) from None


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def dummy_run(tmp_path: Path) -> Path:
    directory = tmp_path / "dummy-run"
    directory.mkdir()
    (directory / "state.toml").write_text(DUMMY_STATE)
    return directory
