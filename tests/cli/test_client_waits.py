"""The client's start path says what it waits for and ends a hopeless wait with one clear line:
the coordinator that does not answer (a real process against a closed port, and the backend
against a silent listener), and why a joined client is not training yet."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path

import pytest
import trio

from psyche.centralized.client import (
    BackendDisconnected,
    CentralizedBackend,
    describe_connect_error,
    join_wait_message,
)
from psyche.centralized.save_state import load_state
from psyche.coordinator import Client, RunState
from psyche.core.cli import UserError
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity

from ..polling import poll_until
from ..processes import Processes, free_port
from .conftest import DUMMY_STATE, command, exit_code, start_client, start_detached


def test_client_says_it_waits_for_the_coordinator_then_gives_up_in_one_line(
    processes: Processes,
) -> None:
    port = free_port()
    client = start_client(processes, f"127.0.0.1:{port}", "--server-connect-timeout", "3")
    waiting = processes.wait_for(
        client,
        rf"waiting for the coordinator at 127\.0\.0\.1:{port} \(connection refused; "
        r"retrying for \d+ s\)",
        60,
    )
    assert exit_code(client, 120) == 1, client.text()
    text = client.text()
    lines = text.splitlines()
    # the time it says is the time it tried: at least the 3 s it was given (a busy machine's
    # last attempt may end later)
    last = re.fullmatch(
        rf"psyche-client: error: cannot connect to the coordinator at 127\.0\.0\.1:{port}: "
        r"connection refused \(tried for (\d+) s\)",
        lines[-1],
    )
    assert last is not None, lines[-1]
    assert int(last.group(1)) >= 3
    assert text.index("connecting to the coordinator") < waiting.start()
    assert "Traceback" not in text


def test_verbose_client_adds_the_traceback(processes: Processes) -> None:
    client = start_client(
        processes, f"127.0.0.1:{free_port()}", "--verbose", "--server-connect-timeout", "0"
    )
    assert exit_code(client, 120) == 1, client.text()
    text = client.text()
    assert "Traceback" in text
    assert "BackendDisconnected" in text
    assert text.splitlines()[-1].startswith("psyche-client: error: cannot connect")


def test_a_malformed_address_fails_at_once(processes: Processes) -> None:
    client = start_client(processes, "localhost")
    assert exit_code(client, 120) == 1, client.text()
    assert client.text().splitlines()[-1] == (
        "psyche-client: error: bad coordinator address: invalid address 'localhost': "
        "expected host:port"
    )


def test_backend_reports_the_wait_and_a_silent_listener_as_no_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="psyche.centralized.client")

    async def main() -> None:
        key = SecretKey.generate()
        with pytest.raises(BackendDisconnected, match=r"connection refused \(tried for"):
            async with CentralizedBackend.connect(
                f"127.0.0.1:{free_port()}", key, "r", connect_timeout=0.5
            ):
                pass
        # A listener that accepts and never speaks: each attempt is bounded by the timeout.
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        held = []

        async def hold(stream: trio.SocketStream) -> None:
            held.append(stream)
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, hold, listeners)
            with trio.fail_after(60), pytest.raises(BackendDisconnected, match="no answer"):
                async with CentralizedBackend.connect(
                    f"127.0.0.1:{port}", key, "r", connect_timeout=1.0
                ):
                    pass
            nursery.cancel_scope.cancel()
        assert held

    trio.run(main)
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        re.fullmatch(
            r"waiting for the coordinator at 127\.0\.0\.1:\d+ \(connection refused; "
            r"retrying for \d+ s\)",
            m,
        )
        for m in messages
    ), messages
    assert issubclass(BackendDisconnected, UserError)


def test_the_client_connects_first_and_joins_after_before_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coordinator is reached (and its absence reported) while the client loads torch; the
    Join is sent only once `before_join` returns, so a run never starts its warmup with a client
    that is still loading."""
    from psyche.centralized.server import open_server
    from psyche.centralized.testing import fast_options
    from psyche.coordinator.testing import quick_coordinator

    order: list[str] = []
    join = CentralizedBackend._join

    async def recorded_join(self: CentralizedBackend, conn: object) -> None:
        order.append("join")
        await join(self, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(CentralizedBackend, "_join", recorded_join)

    async def main() -> None:
        port = free_port()
        async with open_server(quick_coordinator(), fast_options(port=port)) as server:

            async def before_join() -> None:  # connected and authenticated, not joined yet
                order.append(f"before_join (pending {len(server.core.pending_clients)})")

            with trio.fail_after(30):
                async with CentralizedBackend.connect(
                    f"127.0.0.1:{port}", SecretKey.generate(), "test-run", before_join=before_join
                ) as backend:
                    await poll_until(lambda: server.core.pending_clients, 0.05)
                    assert backend.connections == 1
        assert order == ["before_join (pending 0)", "join"]

    trio.run(main)


def test_connect_errors_in_a_few_words() -> None:
    async def refused() -> BaseException:
        try:
            await trio.open_tcp_stream("127.0.0.1", free_port())
        except OSError as e:
            return e
        raise AssertionError("connected to a closed port")

    assert describe_connect_error(trio.run(refused)) == "connection refused"
    unresolved = OSError("all attempts failed")
    unresolved.__cause__ = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert describe_connect_error(unresolved) == (
        "cannot resolve the host name (Name or service not known)"
    )
    assert describe_connect_error(trio.TooSlowError()) == "no answer"


@pytest.fixture
def state(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "state.toml"
    path.write_text(DUMMY_STATE)
    return load_state(path)


def test_why_a_joined_client_is_not_training_yet(state) -> None:  # type: ignore[no-untyped-def]
    me = NodeIdentity.from_single_key(bytes([1]) * 32)
    assert state.run_state is RunState.WaitingForMembers
    assert join_wait_message(state, me, 1) == "waiting for the run to start: 1 of 2 clients joined"
    assert join_wait_message(state, me, None) == (
        "waiting for the run to start: it starts once 2 clients have joined"
    )
    state.run_state = RunState.RoundTrain
    assert join_wait_message(state, me, 3) == (
        "the run is in epoch 0 without this client; it joins at the next epoch's warmup"
    )
    state.run_state = RunState.Paused
    assert join_wait_message(state, me, 3) == "the run is paused; waiting for it to resume"
    state.run_state = RunState.Warmup
    state.epoch_state.clients = [Client(me)]
    assert join_wait_message(state, me, 2) is None  # in the epoch: the client says the rest
    state.epoch_state.clients = []
    state.run_state = RunState.Finished
    assert join_wait_message(state, me, 1) is None


def test_a_wrong_run_id_ends_the_client_with_one_line(
    processes: Processes, dummy_run: Path
) -> None:
    """Issue 24, item 11: `--run-id` naming a run the server does not serve. Before, the client
    printed "joined run" and waited forever (only the server logged the unknown run)."""
    port = free_port()
    server = start_detached(
        processes, "server",
        [command("psyche-server"), "run", "--state", str(dummy_run / "state.toml"),
         "--server-port", str(port), "--tui", "false"],
    )  # fmt: skip
    processes.wait_for(server, r"serving run 'cli-test'", 60)
    client = start_client(processes, f"127.0.0.1:{port}", "--device", "cpu", run_id="cli-tset")
    assert exit_code(client, 120) == 1, client.text()
    text = client.text()
    assert text.splitlines()[-1] == (
        f"psyche-client: error: the coordinator at 127.0.0.1:{port} refused this client: "
        "unknown run id 'cli-tset': this server runs 'cli-test'"
    )
    assert "Traceback" not in text
    assert text.count("unknown run id") == 1
    processes.wait_for(server, r"unknown run id 'cli-tset'", 10)
