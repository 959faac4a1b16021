"""tests/client/workers_leader.py as the client tests start it: a `Leader` (rank 0 of a client
of several ranks, in its own session, its output lines collected as they come, killed with its
whole process group at `stop`), and the waits on processes those tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LEADER = Path(__file__).with_name("workers_leader.py")
DEADLINE = 240.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of someone else still answers kill 0; read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(condition, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Leader:
    """workers_leader.py in its own session, its output lines collected as they come."""

    def __init__(self, mode: str, model_dir: Path, log: Path) -> None:
        self.log = log
        self.out = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, str(LEADER), mode, str(model_dir)],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def line(self, prefix: str, timeout: float = DEADLINE) -> list[str]:
        found: list[list[str]] = []

        def seen() -> bool:
            found[:] = [ln.split()[1:] for ln in self.lines() if ln.split()[:1] == [prefix]]
            if not found and self.proc.poll() is not None:
                raise AssertionError(f"leader exited before {prefix}:\n" + self.tail())
            return bool(found)

        wait_until(seen, prefix, timeout)
        return found[0]

    def tail(self) -> str:
        return "\n".join(self.lines()[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.out.close()
