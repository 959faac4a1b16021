"""Running the rank processes of tests/modeling/parallel_ranks.py (`run_ranks`): what the
determinism tests of several ranks (test_parallel_ranks.py, test_torchtitan_2d.py) share. Each
rank is a real process in its own session, killed with its group if the run outlives `DEADLINE`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("parallel_ranks.py")
DEADLINE = 300.0


def run_ranks(out: Path, device: str, route: str = "", ranks: int = 2) -> tuple[dict, Path]:
    """The `ranks` ranks of parallel_ranks.py on `device` (DisTrO's `route`: "batched" or
    "per-parameter"; the device's default when empty; "fsdp4" with four ranks); their report
    and output directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), str(out / "init"), str(out), device]
            + ([route] if route else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for rank in range(ranks)
    ]
    deadline = time.monotonic() + DEADLINE
    outputs = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(stdout.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * ranks, f"ranks exited {codes}:\n" + "\n".join(o[-3000:] for o in outputs)
    return torch.load(out / "report.pt", weights_only=False), out
