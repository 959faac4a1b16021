"""Shared fixtures of the end-to-end tests: real processes on loopback.

Shared by the tests of the server/testnet (test_server_restart.py, test_local_testnet.py) and of
the client (the training tests); each test file may append its own fixtures here. Keep it small.

* `free_port` fixture: `tests/processes.py`'s `free_port`, a free TCP port on 127.0.0.1.
* `tiny_run(tmp_path)` fixture -> `make(**config) -> Path`: a run directory with `state.toml`
  (the tiny CPU model with short timings, its data server on a free port; keyword arguments
  override `[config]` values; every timer is stretched to this machine's speed,
  `tests/timing.py`) and `data.toml` (a freshly written dataset). Processes must run
  with the repository root as working directory (the model path is relative to it).
* `processes` fixture -> `Processes`: starts commands (`start(name, argv, env=...)`) with their
  output in `tmp_path/<name>.log`, waits for log lines (`wait_for(proc, regex, timeout)`),
  and at teardown interrupts, then kills, every process it started and its process group.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..processes import REPO, Processes, free_port
from ..timing import scaled_timers

TINY = REPO / "configs" / "tiny-cpu"

# Short timings for the tiny run (on an idle two-core machine; `write_tiny_run` scales them);
# clients take ~10 s to import torch before they join.
E2E_CONFIG = {
    "warmup_time": 8,
    "cooldown_time": 3,
    "epoch_time": 12,
    "max_round_train_time": 10,
    "round_witness_time": 1,
    "min_clients": 1,
    "init_min_clients": 2,
    "waiting_for_members_extra_time": 1,
}


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


def write_tiny_run(directory: Path, **config: int) -> Path:
    """`directory/state.toml` + `directory/data.toml` (+ `directory/data/`) for the tiny model,
    its timers (`E2E_CONFIG` with `config` over it) scaled to this machine's speed."""
    from psyche.centralized.tiny_run import write_tiny_dataset

    directory.mkdir(parents=True, exist_ok=True)
    text = (TINY / "state.toml").read_text()
    text = text.replace("127.0.0.1:20001", f"127.0.0.1:{free_port()}")
    for key, value in scaled_timers({**E2E_CONFIG, **config}).items():
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert count == 1, key
    (directory / "state.toml").write_text(text)
    write_tiny_dataset(directory / "data", tokenizer_path=TINY / "model" / "tokenizer.json")
    data = (TINY / "data.toml").read_text().replace('"../../data/tiny-cpu"', '"data"')
    (directory / "data.toml").write_text(data)
    return directory


@pytest.fixture
def tiny_run(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "run", **config: int) -> Path:
        return write_tiny_run(tmp_path / name, **config)

    return make


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@pytest.fixture(name="python_module")
def python_module_fixture() -> Callable[..., list[str]]:
    return python_module


# ---- appended for the training tests (test_training.py): one run shared by a module's tests


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    """`processes` for a whole test module (logs in a module temp dir, stopped at its end)."""
    group = Processes(tmp_path_factory.mktemp("processes"))
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def module_tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_run` for a whole test module."""

    def make(name: str = "run", **config: int) -> Path:
        return write_tiny_run(tmp_path_factory.mktemp(name), **config)

    return make
