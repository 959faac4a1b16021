"""`psyche-server run` as a library (`psyche.centralized.run`), in-process: a server built from
`ServerRunOptions` serves a real client on loopback for a few ticks, with its status page and
trackers, and stops: when its block exits (`open_run`), on SIGINT (`run_server`), or by itself
when the run is finished; a run that cannot start is one line and exit status 1."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from psyche.centralized.options import ServerRunOptions
from psyche.centralized.run import open_run, run_server
from psyche.centralized.save_state import load_state
from psyche.centralized.testing import ProtocolClient
from psyche.coordinator import Coordinator, RunState
from psyche.metrics import ServiceInfo, build_tracker

from ..processes import REPO, free_port

DEADLINE = 60


def tiny_state(directory: Path, run_state: str = "WaitingForMembers") -> Path:
    """The tiny run, one client enough to start it, a one-second warmup, its data not hosted
    (no data server)."""
    text = (REPO / "configs/tiny-cpu/state.toml").read_text()
    for old, new in (
        ('run_state = "WaitingForMembers"', f'run_state = "{run_state}"'),
        ('data_location = { Server = "127.0.0.1:20001" }', 'data_location = "Dummy"'),
        ("init_min_clients = 2", "init_min_clients = 1"),
        ("warmup_time = 10", "warmup_time = 1"),
    ):
        assert old in text
        text = text.replace(old, new)
    path = directory / "state.toml"
    path.write_text(text)
    return path


def loopback(state: Path, **options: Any) -> ServerRunOptions:
    """The options of a server on loopback, logging plainly, without a relay."""
    return ServerRunOptions(
        state=state, tui=False, relay=False, bind_address="127.0.0.1", **options
    )


@pytest.fixture
def root_logging() -> Iterator[None]:
    """`run_server` sets up the process's logging, as the command does; put it back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_open_run_serves_a_client_its_status_page_and_trackers(tmp_path: Path) -> None:
    saves, metrics = tmp_path / "saves", tmp_path / "server.jsonl"
    status_port = free_port()
    options = loopback(
        tiny_state(tmp_path), save_state_dir=saves, metrics_jsonl=metrics, status_port=status_port
    )
    tracker = build_tracker(
        options.tracker_config(),
        service=ServiceInfo.from_env("psyche-centralized-server", "server"),
        run_name="test",
    )
    seen: list[RunState] = []

    def training(state: Coordinator) -> bool:
        seen.append(state.run_state)
        return state.run_state is RunState.RoundTrain

    def status() -> dict[str, object]:
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status.json") as reply:
            return dict(json.load(reply))

    async def main() -> None:
        with trio.fail_after(DEADLINE):
            async with open_run(options, tracker=tracker) as server:
                assert server.coordinator.run_id == "tiny-cpu"
                async with await ProtocolClient.connect(f"127.0.0.1:{server.port}") as client:
                    await client.join("tiny-cpu")
                    # the ticks move the run on: one client starts the warmup, then the round
                    state = await client.wait_for(training, timeout=DEADLINE)
                    assert [c.id for c in state.epoch_state.clients] == [client.identity]
                    page = await trio.to_thread.run_sync(status)
                    assert page["run_id"] == "tiny-cpu"
                    assert page["run_state"] == "RoundTrain"

    try:
        trio.run(main)
    finally:
        tracker.finish()
    assert RunState.Warmup in seen, seen
    assert seen[-1] is RunState.RoundTrain, seen
    saved = load_state(saves)  # when the block exited: a state to resume from
    assert saved.run_id == "tiny-cpu"
    assert saved.run_state_start_unix_timestamp != 0
    logged = [json.loads(line) for line in metrics.open()]
    states = [e["values"]["coordinator/run_state"] for e in logged if e["kind"] == "log"]
    assert states[0] == "WaitingForMembers", states
    assert states[-1] == "RoundTrain", states


def test_run_server_serves_until_sigint(
    tmp_path: Path, root_logging: None, capfd: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    joined: list[str] = []

    def client_then_sigint() -> None:
        """Once a client was served, SIGINT this process (which `run_server` handles)."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)

        async def join() -> None:
            async with await ProtocolClient.connect(f"127.0.0.1:{port}") as client:
                await client.join("tiny-cpu")
                joined.append((await client.next_coordinator()).run_id)

        try:
            trio.run(join)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    helper = threading.Thread(target=client_then_sigint)
    helper.start()
    try:
        code = run_server(loopback(tiny_state(tmp_path), server_port=port))
    finally:
        helper.join(DEADLINE)
    err = capfd.readouterr().err
    assert code == 0, err
    assert joined == ["tiny-cpu"]  # a client was served before the signal
    assert f"serving run 'tiny-cpu' on port {port}" in err
    assert "got SIGINT, shutting down" in err


def test_run_server_ends_with_the_run_and_fails_in_one_line(
    tmp_path: Path, root_logging: None, capfd: pytest.CaptureFixture[str]
) -> None:
    saves = tmp_path / "saves"
    finished = tiny_state(tmp_path, run_state="Finished")
    assert run_server(loopback(finished, save_state_dir=saves)) == 0  # ends by itself, at once
    assert "run 'tiny-cpu' finished at step 1 of 200" in capfd.readouterr().err
    assert load_state(saves).run_state is RunState.Finished

    assert run_server(loopback(tmp_path / "absent.toml")) == 1
    err = capfd.readouterr().err
    assert "Error found in config" in err
    assert "file not found" in err
    keys = tmp_path / "keys"
    keys.write_text("# nobody yet\n")
    assert run_server(loopback(finished, authorized_keys=keys)) == 1
    assert f"{keys} lists no key: nobody could join this run" in capfd.readouterr().err
