"""A client's init given up or failed (real client and network on 127.0.0.1, a real data server
on loopback, the tiny Llama built from its config; the coordinator's states scripted).

Before: an init the run dropped the client from kept its data server connection open (cancelled
while the model was built, or finished just after the drop), the next init started while the
given-up one's model build still ran in its worker thread (two models at once), and any init
failure ended the client, a data server briefly unreachable as much as a run nobody can join
(and that one with a traceback, as a bug). Then: a hub briefly unreachable ended the client (a
data server's blip means rejoin), the next init waited for a given-up download without bound,
and an init that finished as the client ended kept its data connection."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from psyche.client.client import Client, _Work
from psyche.client.round.broadcast import open_network
from psyche.client.setup import init
from psyche.client.setup.init import RunInitConfig
from psyche.client.setup.model_loading import preload_modeling
from psyche.coordinator import Coordinator, LLMTrainingDataLocation, RunState
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.run_state import Client as Member
from psyche.core.cli import report
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.core.token_size import TokenSize
from psyche.data_provider import DataProviderTcpServer, LocalDataProvider
from psyche.network.connection import NetworkConfig
from psyche.network.testing import wait_until

from .hub_endpoint import HubEndpoint, point_huggingface_hub_at
from .in_process import RUN_ID, SEQ, coordinator, write_run
from .scripted_coordinator import WAIT_SECS, ScriptedCoordinator

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


async def _dropped_while_it_loads(
    base: Coordinator, client: Client, backend: ScriptedCoordinator, gate: Gate
) -> None:
    """The warmup's init reaches `gate`, then a health check drops the client: it gives the
    init up (its worker thread held at the gate) and waits to join again."""
    await backend.states.send(_at(base, RunState.Warmup, [ME]))
    await wait_until(lambda: gate.calls == 1, WAIT_SECS)
    await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
    await wait_until(lambda: client.stage == "waiting", WAIT_SECS)


def _record_opened_providers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The data providers the client's inits open, from now on. Held here, as a reference
    cycle or a log record may: garbage collection, which closes a dropped socket at once in
    CPython, does not hide a provider the client did not close."""
    opened: list[Any] = []
    open_data = init._open_data

    async def recording(*args: Any) -> Any:
        opened.append(await open_data(*args))
        return opened[-1]

    monkeypatch.setattr(init, "_open_data", recording)
    return opened


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int, step: str
) -> None:
    """The drop comes while the model is built (the init is cancelled once the thread returns)
    or while its hash is taken, the init's last step (it finishes: its result comes stale)."""
    gate = Gate(getattr(init, step))
    monkeypatch.setattr(init, step, gate)
    opened = _record_opened_providers(monkeypatch)

    async def main() -> None:
        async with _data_server(data_dir, held_port) as server, _client(base) as (client, backend):
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

    base, data_dir = _run(tmp_path, held_port)
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
                await _dropped_while_it_loads(base, client, backend, gate)
                # the next epoch lists it again while the first build still runs
                await backend.states.send(_at(base, RunState.Warmup, [ME], epoch=1))
                await wait_until(lambda: gate.calls == 2 or waits(), WAIT_SECS)
            finally:
                gate.open()
            await wait_until(lambda: client.stage == "running", WAIT_SECS)
            assert gate.calls == 2
            assert gate.most_at_once == 1

    base, _ = _run(tmp_path, None)
    base.config.warmup_time = int(WAIT_SECS)  # it waits, however slow the machine
    trio.run(main)


async def _fails_then_joins_again(
    base: Coordinator,
    client: Client,
    backend: ScriptedCoordinator,
    caplog: pytest.LogCaptureFixture,
) -> list[str]:
    """The warmup's init fails for now (`init_failed`): the client waits, and joins again once
    the run goes on without it. The errors `init_failed` gave."""
    await backend.states.send(_at(base, RunState.Warmup, [ME]))
    await wait_until(lambda: bool(_init_failures(caplog)), WAIT_SECS)
    assert client.stage == "waiting"
    # the run goes on without it: it joins again
    await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
    await wait_until(lambda: backend.rejoins == 1, WAIT_SECS)
    return _init_failures(caplog)


def _init_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.psyche_fields["error"] for r in caplog.records if r.getMessage() == "init_failed"]


def test_an_unreachable_data_server_is_tried_again_at_the_next_warmup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, held_port: int
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.client")

    async def main() -> None:
        async with _client(base) as (client, backend):
            await _fails_then_joins_again(base, client, backend, caplog)
            async with _data_server(data_dir, held_port) as server:
                await backend.states.send(_at(base, RunState.Warmup, [ME], epoch=1))
                await wait_until(lambda: client.stage == "running", WAIT_SECS)
                assert len(server.connected_clients()) == 1

    base, data_dir = _run(tmp_path, held_port)
    trio.run(main)


HUB_REPO = "psyche-tests/tiny-llama"


# A hub out of reach, as the client first meets it: refusing connections, or answering every
# request with a server error. A name that does not resolve is a `ModelUnreachable` as these are
# (test_hub_outage.py, whose child process has no network: a lookup here would ask real DNS).
HUB_OUTAGES = ["refused", "500", "503"]


@pytest.mark.parametrize("outage", HUB_OUTAGES)
def test_an_unreachable_hub_is_tried_again_at_the_next_warmup(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    held_port: int,
    outage: str,
) -> None:
    """A hub download that cannot connect, or that the hub answers with a 5xx (a network blip,
    a hub having a bad minute) leaves the epoch and joins again, as a data server that cannot be
    reached does, instead of ending the client (before: only a refused connection did; a 5xx
    ended it)."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    hub = HubEndpoint()

    async def main() -> None:
        async with _client(base) as (client, backend):
            (error,) = await _fails_then_joins_again(base, client, backend, caplog)
            assert "failed to load model" in error
            assert HUB_REPO in error
            hub.fail_status = None  # the hub is back
            point_huggingface_hub_at(monkeypatch, hub.url, tmp_path / "hf-home")
            await backend.states.send(_at(base, RunState.Warmup, [ME], epoch=1))
            await wait_until(lambda: client.stage == "running", WAIT_SECS)

    base, _ = _run(tmp_path, None)
    hub.create_repo(HUB_REPO, {"config.json": (tmp_path / "model/config.json").read_bytes()})
    base.model.value.checkpoint = Checkpoint.Hub(HubRepo(HUB_REPO))
    with hub.serving():
        if outage.isdigit():
            hub.fail_status = int(outage)
        url = f"http://127.0.0.1:{held_port}" if outage == "refused" else hub.url
        point_huggingface_hub_at(monkeypatch, url, tmp_path / "hf-home")
        trio.run(main)


def test_a_hub_repo_that_is_not_there_ends_the_client_in_one_line(
    tmp_path: Path, hub: HubEndpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub answered: waiting for the next warmup changes nothing."""
    base, _ = _run(tmp_path, None)
    base.model.value.checkpoint = Checkpoint.Hub(HubRepo(HUB_REPO))
    (line,) = _ends_the_client(base, capsys)
    assert line.startswith("psyche-client: error: failed to load model: ")
    assert HUB_REPO in line


def _ends_the_client(base: Coordinator, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The client at `base`'s warmup must end (exit status 1): the lines it printed."""

    async def main() -> None:
        async with _client(base) as (_, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            with trio.fail_after(WAIT_SECS):
                await trio.sleep_forever()  # until the client ends

    with pytest.raises(BaseExceptionGroup) as ended:
        trio.run(main)
    assert report("psyche-client", ended.value) == 1
    return capsys.readouterr().err.splitlines()


def test_a_run_nobody_can_join_ends_the_client_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = _run(tmp_path, None)
    base.model.value.checkpoint = Checkpoint.Ephemeral()
    assert _ends_the_client(base, capsys) == [
        "psyche-client: error: Model is Ephemeral, it's impossible to join this run."
    ]


@pytest.mark.parametrize("kind", ["Local", "Preprocessed"])
def test_a_data_directory_missing_on_this_machine_ends_the_client_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Local data that is not there will not come back by waiting for the next warmup (a data
    server might): the client ends with one line naming the path instead of retrying forever.
    A preprocessed dataset is a local directory too."""
    base, _ = _run(tmp_path, None)
    missing = tmp_path / "no-such-data"
    base.model.value.data_location = getattr(LLMTrainingDataLocation, kind)(str(missing))
    (line,) = _ends_the_client(base, capsys)
    assert line.startswith("psyche-client: error: Couldn't initialize data provider")
    assert str(missing) in line


def test_a_client_the_run_drops_while_it_trains_closes_its_data_connection(
    tmp_path: Path, held_port: int
) -> None:
    """The machine's data provider (its connection to the run's data server) is closed when the
    run goes on without the client, not left open beside the next epoch's (each rejoin would
    otherwise hold one more connection until the provider is collected)."""

    async def main() -> None:
        async with _data_server(data_dir, held_port) as server, _client(base) as (client, backend):
            await backend.states.send(_at(base, RunState.Warmup, [ME]))
            await wait_until(lambda: client.stage == "running", WAIT_SECS)
            assert len(server.connected_clients()) == 1
            held = client.machine.fetcher.provider  # type: ignore[union-attr]
            await backend.states.send(_at(base, RunState.RoundTrain, [OTHER]))
            await wait_until(lambda: backend.rejoins == 1, WAIT_SECS)
            assert client.stage == "waiting"
            await wait_until(lambda: not server.connected_clients(), WAIT_SECS)
            assert held is not None  # held here, so only the client's close can end it

    base, data_dir = _run(tmp_path, held_port)
    trio.run(main)


def test_the_next_init_leaves_its_epoch_when_the_given_up_download_outlasts_the_warmup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A given-up init's hub download (or model build) runs on in its worker thread: the next
    warmup's init waits for it no longer than that warmup, then leaves the epoch and joins again
    (before: it waited as long as the download took, however long)."""
    caplog.set_level(logging.INFO, logger="psyche.client")
    gate = Gate(init.load_hub_checkpoint)
    monkeypatch.setattr(init, "load_hub_checkpoint", gate)

    async def main() -> None:
        async with _client(base) as (client, backend):
            try:
                await _dropped_while_it_loads(base, client, backend, gate)
                short = _at(base, RunState.Warmup, [ME], epoch=1)
                short.config.warmup_time = 1
                await backend.states.send(short)
                await wait_until(lambda: bool(_init_failures(caplog)), WAIT_SECS)
                (error,) = _init_failures(caplog)
                assert "worker thread" in error
                assert gate.calls == 1
                assert client.stage == "waiting"
                # the epoch went on without it: it joins again
                await backend.states.send(_at(base, RunState.RoundTrain, [OTHER], epoch=1))
                await wait_until(lambda: backend.rejoins == 2, WAIT_SECS)
            finally:
                gate.open()

    base, _ = _run(tmp_path, None)
    trio.run(main)


def test_an_init_that_finishes_as_the_client_ends_closes_its_data_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int
) -> None:
    """The init's result was still queued when the client stopped (its loop busy with earlier
    work): nothing would take it, so the client closes its data provider on the way out."""
    gate = Gate(init.live_model_hash)
    monkeypatch.setattr(init, "live_model_hash", gate)
    opened = _record_opened_providers(monkeypatch)

    async def main() -> None:
        async with _data_server(data_dir, held_port) as server:
            async with _client(base) as (client, backend):
                try:
                    await backend.states.send(_at(base, RunState.Warmup, [ME]))
                    await wait_until(
                        lambda: gate.calls == 1 and bool(server.connected_clients()), WAIT_SECS
                    )
                    # queued before the init's result: the loop is in it when the init ends
                    client._post(_Work("busy", trio.sleep_forever))
                finally:
                    gate.open()
                # the init has ended (it posts its result as it releases the lock)
                await wait_until(lambda: not client._init_lock.locked(), WAIT_SECS)
                assert client.stage == "initializing"
                assert client.machine is None
            await wait_until(lambda: not server.connected_clients(), WAIT_SECS)
            assert len(opened) == 1

    base, data_dir = _run(tmp_path, held_port)
    trio.run(main)
