"""A client's init given up or failed (real client and network on 127.0.0.1, a real data server
on loopback, the tiny Llama built from its config; the coordinator's states scripted).

Before: an init the run dropped the client from kept its data server connection open (cancelled
while the model was built, or finished just after the drop), the next init started while the
given-up one's model build still ran in its worker thread (two models at once), and any init
failure ended the client, a data server briefly unreachable as much as a run nobody can join
(and that one with a traceback, as a bug)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from psyche.client.client import Client
from psyche.client.round.broadcast import open_network
from psyche.client.setup import init
from psyche.client.setup.init import RunInitConfig
from psyche.client.setup.model_loading import preload_modeling
from psyche.coordinator import Coordinator, LLMTrainingDataLocation, RunState
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.run_state import Client as Member
from psyche.core.cli import report
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.core.token_size import TokenSize
from psyche.data_provider import DataProviderTcpServer, LocalDataProvider
from psyche.network.connection import NetworkConfig
from psyche.network.testing import wait_until

from .test_dropped_joiner import WAIT_SECS, ScriptedCoordinator
from .test_in_process_run import RUN_ID, SEQ, coordinator, write_run

KEYS = [SecretKey.from_bytes(n.to_bytes(32, "big")) for n in (1, 2)]
ME, OTHER = (NodeIdentity.from_single_key(k.public_key) for k in KEYS)


class Gate:
    """One of init's steps that run in a worker thread, its first call held until `open()`;
    counts the calls and the most in flight at once."""

    def __init__(self, step: Callable[..., Any]) -> None:
        self._step = step
        self._opened = threading.Event()
        self._lock = threading.Lock()
        self.calls = 0
        self.in_flight = 0
        self.most_at_once = 0

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
        try:
            if first:
                self._opened.wait(2 * WAIT_SECS)  # bounded: a failed test opens it too
            return self._step(*args)
        finally:
            with self._lock:
                self.in_flight -= 1

    def open(self) -> None:
        self._opened.set()


def _at(
    base: Coordinator, run_state: RunState, members: list[NodeIdentity], epoch: int = 0
) -> Coordinator:
    state = base.copy()
    state.run_state = run_state
    state.progress.epoch = epoch
    state.epoch_state.clients = [Member(identity) for identity in members]
    return state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def _data_server(data_dir: Path, port: int = 0) -> AsyncIterator[DataProviderTcpServer]:
    local = LocalDataProvider.new_from_directory(
        data_dir, TokenSize.TwoBytes, SEQ, Shuffle.DontShuffle()
    )
    try:
        async with DataProviderTcpServer.start(
            local, host="127.0.0.1", port=port, allowed=[KEYS[0].public_key]
        ) as server:
            yield server
    finally:
        local.close()


@asynccontextmanager
async def _client(base: Coordinator) -> AsyncIterator[tuple[Client, ScriptedCoordinator]]:
    """The client (`ME`) running on scripted states, its init's gates opened when it ends."""
    async with (
        open_network(NetworkConfig(RUN_ID, KEYS[0], bind_host="127.0.0.1")) as network,
        trio.open_nursery() as nursery,
    ):
        backend = ScriptedCoordinator()
        client = Client(backend, network, RunInitConfig(ME, KEYS[0], RUN_ID, device="cpu"))
        nursery.start_soon(client.run)
        yield client, backend
        nursery.cancel_scope.cancel()


def _run(tmp_path: Path, port: int | None) -> tuple[Coordinator, Path]:
    """The run (its data on the data server at `port`), and its data directory."""
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    base = coordinator(model_dir, data_dir)
    if port is not None:
        base.model.value.data_location = LLMTrainingDataLocation.Server(f"127.0.0.1:{port}")
    return base, data_dir


@pytest.mark.parametrize("step", ["load_hub_checkpoint", "live_model_hash"])
def test_an_init_given_up_closes_its_data_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The drop comes while the model is built (the init is cancelled once the thread returns)
    or while its hash is taken, the init's last step (it finishes: its result comes stale)."""
    gate = Gate(getattr(init, step))
    monkeypatch.setattr(init, step, gate)
    port = _free_port()
    # held here, as a reference cycle or a log record may: garbage collection, which closes a
    # dropped socket at once in CPython, does not hide a provider the client did not close
    opened: list[Any] = []
    open_data = init._open_data

    async def recording(*args: Any) -> Any:
        opened.append(await open_data(*args))
        return opened[-1]

    monkeypatch.setattr(init, "_open_data", recording)

    async def main() -> None:
        async with _data_server(data_dir, port) as server, _client(base) as (client, backend):
            try:
                await backend.states.send(_at(base, RunState.Warmup, [ME]))
                await wait_until(
                    lambda: gate.calls == 1 and bool(server.connected_clients()), WAIT_SECS
                )
                # a health check dropped it: the round goes on without it
                await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
                await wait_until(lambda: client.stage == "waiting", WAIT_SECS)
            finally:
                gate.open()
            await wait_until(lambda: not server.connected_clients(), WAIT_SECS)
            assert client.machine is None
            assert len(opened) == 1

    base, data_dir = _run(tmp_path, port)
    trio.run(main)


def test_the_next_init_waits_for_the_given_up_model_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    gate = Gate(init.load_hub_checkpoint)
    monkeypatch.setattr(init, "load_hub_checkpoint", gate)

    def waits() -> bool:
        return any(r.getMessage() == "init_waits" for r in caplog.records)

    async def main() -> None:
        async with _client(base) as (client, backend):
            try:
                await backend.states.send(_at(base, RunState.Warmup, [ME]))
                await wait_until(lambda: gate.calls == 1, WAIT_SECS)
                await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
                await wait_until(lambda: client.stage == "waiting", WAIT_SECS)
                # the next epoch lists it again while the first build still runs
                await backend.states.send(_at(base, RunState.Warmup, [ME], epoch=1))
                await wait_until(lambda: gate.calls == 2 or waits(), WAIT_SECS)
            finally:
                gate.open()
            await wait_until(lambda: client.stage == "running", WAIT_SECS)
            assert gate.calls == 2
            assert gate.most_at_once == 1

    base, _ = _run(tmp_path, None)
    trio.run(main)


def test_an_unreachable_data_server_is_tried_again_at_the_next_warmup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")
    port = _free_port()  # nothing listens there yet

    async def main() -> None:
        async with _client(base) as (client, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            await wait_until(
                lambda: any(r.getMessage() == "init_failed" for r in caplog.records), WAIT_SECS
            )
            assert client.stage == "waiting"
            # the run goes on without it: it joins again
            await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
            await wait_until(lambda: backend.rejoins == 1, WAIT_SECS)
            async with _data_server(data_dir, port) as server:
                await backend.states.send(_at(base, RunState.Warmup, [ME], epoch=1))
                await wait_until(lambda: client.stage == "running", WAIT_SECS)
                assert len(server.connected_clients()) == 1

    base, data_dir = _run(tmp_path, port)
    trio.run(main)


def test_a_run_nobody_can_join_ends_the_client_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = _run(tmp_path, None)
    base.model.value.checkpoint = Checkpoint.Ephemeral()

    async def main() -> None:
        async with _client(base) as (_, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            with trio.fail_after(WAIT_SECS):
                await trio.sleep_forever()  # until the client ends

    with pytest.raises(BaseExceptionGroup) as ended:
        trio.run(main)
    assert report("psyche-client", ended.value) == 1
    assert capsys.readouterr().err.splitlines() == [
        "psyche-client: error: Model is Ephemeral, it's impossible to join this run."
    ]


def test_a_data_directory_missing_on_this_machine_ends_the_client_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Local data that is not there will not come back by waiting for the next warmup (a data
    server might): the client ends with one line naming the path instead of retrying forever."""
    base, _ = _run(tmp_path, None)
    missing = tmp_path / "no-such-data"
    base.model.value.data_location = LLMTrainingDataLocation.Local(str(missing))

    async def main() -> None:
        async with _client(base) as (_, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            with trio.fail_after(WAIT_SECS):
                await trio.sleep_forever()  # until the client ends

    with pytest.raises(BaseExceptionGroup) as ended:
        trio.run(main)
    assert report("psyche-client", ended.value) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("psyche-client: error: Couldn't initialize data provider")
    assert str(missing) in line


def test_a_client_the_run_drops_while_it_trains_closes_its_data_connection(
    tmp_path: Path,
) -> None:
    """The machine's data provider (its connection to the run's data server) is closed when the
    run goes on without the client, not left open beside the next epoch's (each rejoin would
    otherwise hold one more connection until the provider is collected)."""
    port = _free_port()

    async def main() -> None:
        async with _data_server(data_dir, port) as server, _client(base) as (client, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            await wait_until(lambda: client.stage == "running", WAIT_SECS)
            assert len(server.connected_clients()) == 1
            held = client.machine.fetcher.provider  # type: ignore[union-attr]
            await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
            await wait_until(lambda: backend.rejoins == 1, WAIT_SECS)
            assert client.stage == "waiting"
            await wait_until(lambda: not server.connected_clients(), WAIT_SECS)
            assert held is not None  # held here, so only the client's close can end it

    base, data_dir = _run(tmp_path, port)
    trio.run(main)
