"""The server's end: once the run is Finished it waits for its clients to leave (or a grace
period), saves its state, logs a summary and ends its block by itself; and a port it cannot
listen on is named in one line. Real loopback TCP, the server's clock 10x the wall clock."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import trio

from psyche.centralized.save_state import load_state
from psyche.centralized.server import ServerStartError, open_server
from psyche.centralized.testing import ProtocolClient, fast_options
from psyche.coordinator import RunState
from psyche.coordinator.testing import quick_coordinator

from .servers import addr, hosted


def test_a_finished_run_ends_the_server_once_its_clients_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.centralized")
    saves = tmp_path / "saves"
    # one step: the epoch (no witnesses, so everyone is withdrawn) ends the run
    coordinator = quick_coordinator(total_steps=1)
    after_body: list[str] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with open_server(coordinator, fast_options(save_state_dir=saves)) as server:
                a, b = [await ProtocolClient.connect(addr(server)) for _ in range(2)]
                for client in (a, b):
                    await client.join("test-run")
                await a.wait_for(lambda s: s.run_state is RunState.Finished, timeout=20)
                assert server.finished.is_set()
                await a.conn.aclose()
                # one client is still connected: the server still serves it
                await b.wait_for(lambda s: s.run_state is RunState.Finished)
                await b.conn.aclose()
                await trio.sleep_forever()  # the server ends the block itself
            after_body.append("the block returned normally")

    trio.run(main)
    assert after_body
    assert load_state(saves).run_state is RunState.Finished
    assert "run 'test-run' finished at step 1 of 1 (1 epoch," in caplog.text
    assert f"state saved to {saves}" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_stays_is_waited_for_only_the_grace_period() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            options = fast_options(finished_grace=0.5)
            async with open_server(quick_coordinator(total_steps=1), options) as server:
                a, b = [await ProtocolClient.connect(addr(server)) for _ in range(2)]
                for client in (a, b):
                    await client.join("test-run")
                await a.wait_for(lambda s: s.run_state is RunState.Finished, timeout=20)
                await trio.sleep_forever()  # nobody leaves; the grace period ends it

    trio.run(main)


def test_a_state_that_is_finished_already_ends_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="psyche.centralized")
    coordinator = quick_coordinator(total_steps=1)
    coordinator.run_state = RunState.Finished
    coordinator.progress.step = 1

    async def main() -> None:
        with trio.fail_after(10):
            async with open_server(coordinator, fast_options()):
                await trio.sleep_forever()

    trio.run(main)
    assert "finished at step 1 of 1" in caplog.text


def test_a_finished_run_keeps_serving_when_told_to() -> None:
    coordinator = quick_coordinator(total_steps=1)
    coordinator.run_state = RunState.Finished

    async def main() -> None:
        async with open_server(coordinator, fast_options(exit_when_finished=False)) as server:
            with trio.move_on_after(20 * server.options.tick_interval) as scope:
                await trio.sleep_forever()
            assert scope.cancelled_caught  # our own timeout, not the server's

    trio.run(main)


def test_a_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def start(coordinator, options) -> None:  # type: ignore[no-untyped-def]
            async with open_server(coordinator, options):
                pass

        with pytest.raises(ServerStartError) as error:
            trio.run(start, quick_coordinator(), fast_options(port=port))
        assert str(error.value) == (
            f"the coordinator port {port} (--server-port) on 127.0.0.1 (--bind-address) is "
            "already in use (another server, or another program, listens there)"
        )

        coordinator, data = hosted(tmp_path, port=port)
        with pytest.raises(ServerStartError) as error:
            trio.run(start, coordinator, fast_options(data_config=data))
        assert str(error.value).startswith(
            f"the data server's port {port} (data_location 127.0.0.1:{port} in the state file) "
            "on 127.0.0.1 (--bind-address) "
            "is already in use"
        )
