"""Every console command stops cleanly on SIGINT and on SIGTERM, even when it was started with
SIGINT ignored (a background job of a script, `nohup`): real processes, generous deadlines.

Exit codes (psyche.core.cli): commands that serve until stopped (`psyche-server run`,
`psyche-local-testnet start --headless`, `psyche-solana-client localnet`) exit 0; the others
130 after SIGINT and 143 after SIGTERM, once their cleanups ran."""

from __future__ import annotations

import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ..processes import REPO, Processes, free_port
from .conftest import command, exit_code, start_client, start_detached
from .support import alive

SIGNALS = pytest.mark.parametrize(
    ("signum", "name"), [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")]
)
STOP_TIMEOUT = 60.0


@SIGNALS
def test_server(processes: Processes, dummy_run: Path, signum: int, name: str) -> None:
    server = start_detached(
        processes,
        "server",
        [command("psyche-server"), "run", "--state", str(dummy_run / "state.toml"),
         "--server-port", str(free_port()), "--tui", "false"],
    )  # fmt: skip
    processes.wait_for(server, r"serving run 'cli-test'", 60)
    processes.signal(server, signum)
    assert exit_code(server, STOP_TIMEOUT) == 0, server.text()
    assert f"got {name}" in server.text()
    assert "Traceback" not in server.text()


@SIGNALS
def test_client_waiting_for_the_run(
    processes: Processes, dummy_run: Path, signum: int, name: str
) -> None:
    port = free_port()
    server = start_detached(
        processes,
        "server",
        [command("psyche-server"), "run", "--state", str(dummy_run / "state.toml"),
         "--server-port", str(port), "--tui", "false"],
    )  # fmt: skip
    processes.wait_for(server, r"serving run 'cli-test'", 60)
    client = start_client(processes, f"127.0.0.1:{port}", "--device", "cpu", run_id="cli-test")
    processes.wait_for(client, r"waiting for the run to start: 1 of 2 clients joined", 90)
    processes.signal(client, signum)
    code = exit_code(client, STOP_TIMEOUT)
    assert code == (130 if signum == signal.SIGINT else 143), client.text()
    assert f"interrupted by {name}; exiting" in client.text()
    assert "Traceback" not in client.text()


@SIGNALS
def test_client_waiting_for_the_coordinator(processes: Processes, signum: int, name: str) -> None:
    client = start_client(processes, f"127.0.0.1:{free_port()}", "--server-connect-timeout", "600")
    processes.wait_for(client, r"waiting for the coordinator at", 60)
    processes.signal(client, signum)
    assert exit_code(client, STOP_TIMEOUT) == (130 if signum == signal.SIGINT else 143)
    assert "Traceback" not in client.text()


@SIGNALS
def test_solana_localnet(processes: Processes, signum: int, name: str) -> None:
    localnet = start_detached(
        processes, "localnet", [command("psyche-solana-client"), "localnet", "--port", "0"]
    )
    processes.wait_for(localnet, r"JSON-RPC: http://", 90)
    processes.signal(localnet, signum)
    assert exit_code(localnet, STOP_TIMEOUT) == 0, localnet.text()
    assert "Traceback" not in localnet.text()


@SIGNALS
def test_headless_testnet_stops_every_child(
    processes: Processes, dummy_run: Path, signum: int, name: str
) -> None:
    sleeper = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(3600)'"
    testnet = start_detached(
        processes,
        "testnet",
        [command("psyche-local-testnet"), "start", "--num-clients", "2",
         "--config-path", str(dummy_run), "--server-port", str(free_port()), "--headless",
         "--client-program", sleeper],
        cwd=dummy_run,
    )  # fmt: skip
    processes.wait_for(testnet, r"\[client-2\] started \(pid \d+\)", 90)
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)\)", testnet.text())]
    assert len(pids) == 3
    assert all(alive(pid) for pid in pids)
    processes.signal(testnet, signum)
    assert exit_code(testnet, STOP_TIMEOUT) == 0, testnet.text()
    assert f"[testnet] got {name}; stopping" in testnet.text()
    assert not [pid for pid in pids if alive(pid)], testnet.text()


@SIGNALS
def test_train_saves_what_it_trained(
    processes: Processes,
    tmp_path: Path,
    tiny_data: Callable[[Path], Path],
    signum: int,
    name: str,
) -> None:
    save = tmp_path / "model"
    train = start_detached(
        processes,
        "train",
        [command("psyche-train"), "--data-path", str(tiny_data(tmp_path / "data")),
         "--total-steps", "1000000", "--device", "cpu", "--save-path", str(save)],
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    processes.wait_for(train, r"step: 2, ", 120)
    processes.signal(train, signum)
    assert exit_code(train, STOP_TIMEOUT) == (130 if signum == signal.SIGINT else 143)
    text = train.text()
    assert f"interrupted by {name}, stopping" in text
    assert "Traceback" not in text
    assert "Saved checkpoint to" in text
    assert (save / "config.json").is_file()


@pytest.fixture
def tiny_data() -> Callable[[Path], Path]:
    def write(directory: Path) -> Path:
        from psyche.centralized.tiny_run import write_tiny_dataset

        write_tiny_dataset(directory, tokenizer_path=REPO / "configs/tiny-cpu/model/tokenizer.json")
        return directory

    return write
