"""The server over real loopback TCP, with clients speaking the protocol.

The server's clock runs 10x the wall clock here (`fast_options`), so a run's timings of a few
"seconds" pass in a fraction of a second.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio

from psyche.centralized.client import BackendDisconnected, CentralizedBackend, ExtensionsMismatch
from psyche.centralized.protocol import (
    EXTENSIONS_VERSION,
    ClientToServerMessage,
    ExtensionHello,
    ServerToClientMessage,
)
from psyche.centralized.server import (
    CentralizedServer,
    ServerStartError,
    check_checkpoint_for_hosting,
    open_server,
    serve_coordinator,
)
from psyche.centralized.testing import ProtocolClient, fast_options
from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.model import Checkpoint, HubRepo, LLMTrainingDataLocation
from psyche.coordinator.run_config import load_state_toml
from psyche.coordinator.testing import quick_coordinator, warmup_witness_for
from psyche.core.batch_id import BatchId
from psyche.core.ed25519_strict import IDENTITY, compress, verify_rfc8032
from psyche.core.identity import SecretKey
from psyche.core.serde import to_bytes
from psyche.data_provider import DataProviderError, DataProviderTcpClient
from psyche.network.discovery import sign_address_record
from psyche.network.ticket import EndpointAddr, TransportAddr
from psyche.transport import (
    CHALLENGE_LENGTH,
    FramedStream,
    LoginRefused,
    encode_challenge_response,
    encode_else,
    split_envelope,
)

from ..processes import REPO, free_port
from ..timing import scaled
from .servers import addr, eventually, hosted


def test_join_by_run_id_and_a_broadcast_every_tick() -> None:
    async def main() -> None:
        async with (
            open_server(quick_coordinator(init_min_clients=3), fast_options()) as server,
            await ProtocolClient.connect(addr(server)) as good,
            await ProtocolClient.connect(addr(server)) as lost,
            await ProtocolClient.connect(addr(server)) as stranger,
        ):
            await good.join("test-run")
            await lost.join("another-run")
            # a Join for another run is answered: refused for good, and the connection closed
            with trio.fail_after(10), pytest.raises(LoginRefused) as refused:
                await receive_forever(lost)
            assert refused.value.permanent
            assert refused.value.reason == (
                "unknown run id 'another-run': this server runs 'test-run'"
            )
            await eventually(lambda: lost.conn.identity not in server.connected_clients())
            assert list(server.core.pending_clients) == [good.identity]
            with trio.move_on_after(0.1):  # the states sent meanwhile
                while True:
                    await good.receive()
            ticks = server.ticks
            states = [await good.next_coordinator() for _ in range(4)]
            assert server.ticks >= ticks + 3  # every tick broadcasts (0.05 s apart here)
            assert all(s.run_state is RunState.WaitingForMembers for s in states)
            # a connected stranger gets broadcasts too (upstream sends to every connection)
            assert (await stranger.next_coordinator()).run_id == "test-run"

    trio.run(main)


def test_a_disconnect_overtaken_by_the_clients_new_connection_changes_nothing() -> None:
    """A client that reconnects at once: its old connection's `Disconnected` event can reach the
    server after the new connection's `Join` (the transport delivers it from a task of its own).
    It must not undo that Join: before, the client sat connected and never pending for the rest
    of the run (an end-to-end run under load: a banned member that came back)."""

    async def main() -> None:
        async with open_server(quick_coordinator(init_min_clients=3), fast_options()) as server:
            key = SecretKey.generate()
            async with await ProtocolClient.connect(addr(server), key) as first:
                await first.join("test-run")
                await eventually(lambda: first.identity in server.core.pending_clients)
            async with await ProtocolClient.connect(addr(server), key) as second:
                await second.join("test-run")
                await eventually(lambda: server.tcp.connected_clients() == [key.public_key])
                await eventually(lambda: second.identity in server.core.pending_clients)
                server.on_disconnect(key.public_key)  # the first connection's event, late
                assert second.identity in server.core.pending_clients
            # a disconnect of the live connection still counts
            await eventually(lambda: second.identity not in server.core.pending_clients)

    trio.run(main)


def test_warmup_then_a_disconnect_withdraws_the_client(tmp_path: Path) -> None:
    # A warmup longer than any wait here: the disconnect, not the warmup's timer, must end it
    # (with the 2 s warmup a busy machine noticed b's close after the warmup had ended: CI
    # run 34, no client left in the epoch state).
    coordinator = quick_coordinator(warmup_time=60)

    async def main() -> None:
        async with open_server(coordinator, fast_options(events_dir=tmp_path)) as server:
            a = await ProtocolClient.connect(addr(server))
            b = await ProtocolClient.connect(addr(server))
            await a.join("test-run")
            await b.join("test-run")
            state = await a.wait_for(lambda s: s.run_state is RunState.Warmup)
            assert [c.id for c in state.epoch_state.clients] == [a.identity, b.identity]
            await b.conn.aclose()
            state = await a.wait_for(lambda s: s.run_state is RunState.WaitingForMembers)
            # upstream test 4: one client left in the epoch state, one pending
            assert [c.id for c in state.epoch_state.clients] == [a.identity]
            assert list(server.core.pending_clients) == [a.identity]
            await a.conn.aclose()

    trio.run(main)
    # --events-dir recorded every distinct state, the transitions included
    from psyche.centralized.events import STATE_FILE, read_events

    records = [c for _, c in read_events(tmp_path / STATE_FILE)]
    states = [c.run_state for c in records]
    assert RunState.Warmup in states
    assert states[-1] is RunState.WaitingForMembers
    encoded = [c.to_bytes() for c in records]
    assert all(a != b for a, b in itertools.pairwise(encoded))  # only changes are recorded


async def raw_handshake(port: int, key: SecretKey | None = None) -> FramedStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    framed = FramedStream(stream, max_receive_frame=1 << 26, max_send_frame=1 << 26)
    frame = await framed.receive()
    assert frame is not None
    tag, challenge = split_envelope(frame)
    assert tag == 0
    assert len(challenge) == CHALLENGE_LENGTH
    await framed.send(encode_challenge_response(key or SecretKey.generate(), bytes(challenge)))
    return framed


async def closed_by_server(framed: FramedStream) -> bool:
    """Read until the server closes the connection (broadcasts may arrive first)."""
    with trio.fail_after(5):
        while True:
            try:
                if await framed.receive() is None:
                    return True
            except (trio.BrokenResourceError, OSError):
                return True
            except Exception:  # e.g. a frame cut by the close
                return True


def test_hostile_connections_are_closed_and_the_others_keep_going() -> None:
    async def main() -> None:
        async with open_server(quick_coordinator(), fast_options()) as server:
            good = await ProtocolClient.connect(addr(server))
            await good.join("test-run")
            port = server.port

            # garbage instead of a handshake
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"\x00\x00\x00\x05hello")
            framed = FramedStream(stream, max_receive_frame=1 << 20, max_send_frame=1 << 20)
            assert await closed_by_server(framed)

            hostile_frames = [
                encode_else(b"\x09"),  # an unknown message variant
                encode_else(b"\x00\x10ab"),  # a Join whose string is cut short
                encode_else(b"\x00\x02\xff\xfe"),  # not UTF-8
                b"\x05",  # an unknown envelope variant
                b"\x00\x01\x00",  # a second ChallengeResponse
                encode_else(b"\x02" + b"\x00" * 30_000),  # longer than any health check
            ]
            for payload in hostile_frames:
                framed = await raw_handshake(port)
                await framed.send(payload)
                assert await closed_by_server(framed), payload

            # a frame header announcing more than the server's 8 MiB limit
            framed = await raw_handshake(port)
            await framed._stream.send_all((9 * 1024 * 1024).to_bytes(4, "big"))
            assert await closed_by_server(framed)

            # a bad signature: never registered
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            framed = FramedStream(stream, max_receive_frame=1 << 20, max_send_frame=1 << 20)
            frame = await framed.receive()
            assert frame is not None
            response = bytearray(encode_challenge_response(SecretKey.generate(), bytes(32)))
            await framed.send(bytes(response))  # signs the wrong challenge
            assert await closed_by_server(framed)

            # a small-order key (the identity's encoding) "signing" the challenge with
            # (R = identity, S = 0): OpenSSL's plain check accepts it for every message, so a
            # member could be admitted under a key anyone can sign for; strict verification
            # (dalek's `verify_strict`, upstream's) refuses it
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            framed = FramedStream(stream, max_receive_frame=1 << 20, max_send_frame=1 << 20)
            frame = await framed.receive()
            assert frame is not None
            challenge = bytes(split_envelope(frame)[1])
            honest = SecretKey.generate()
            forged_signature = compress(IDENTITY) + bytes(32)
            assert verify_rfc8032(compress(IDENTITY), bytes([32]) + challenge, forged_signature)
            response = encode_challenge_response(honest, challenge)
            response = response.replace(honest.public_key, compress(IDENTITY))
            response = response[:-64] + forged_signature
            await framed.send(response)
            assert await closed_by_server(framed)

            # the honest client is still served, still pending, and the server still ticks
            # (updates also follow joins and other members' messages, so count the ticks
            # themselves: the server must tick again while the honest client is served)
            ticks = server.ticks
            with trio.fail_after(scaled(60)):
                while server.ticks <= ticks:
                    await good.next_coordinator()
            assert list(server.core.pending_clients) == [good.identity]
            assert len(server.connected_clients()) == 1
            await good.conn.aclose()

    trio.run(main)


def endpoint_record(key: SecretKey, port: int) -> bytes:
    addr = EndpointAddr(key.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")])
    return sign_address_record(key, addr)


def test_extension_clients_get_extras_and_each_others_endpoints() -> None:
    coordinator = quick_coordinator(init_min_clients=5)
    backups = [LLMTrainingDataLocation.Local("/backup/data")]
    coordinator.model.value.backup_data_locations = backups  # type: ignore[attr-defined]

    async def main() -> None:
        async with open_server(coordinator, fast_options()) as server:
            keys = [SecretKey.generate() for _ in range(3)]
            a, b, upstream = [await ProtocolClient.connect(addr(server), k) for k in keys]
            for client in (a, b):
                await client.send(ClientToServerMessage.ExtensionHello(ExtensionHello()))
            for client in (a, b, upstream):
                await client.join("test-run")
            record_a, record_b = endpoint_record(keys[0], 1000), endpoint_record(keys[1], 2000)
            await a.send(ClientToServerMessage.AnnounceEndpoint(record_a))
            # a record for somebody else is refused
            await b.send(ClientToServerMessage.AnnounceEndpoint(endpoint_record(keys[2], 3)))
            await b.send(ClientToServerMessage.AnnounceEndpoint(record_b))

            async def endpoints_of(client: ProtocolClient, expected: list[bytes]) -> None:
                with trio.fail_after(5):
                    while True:
                        message = await client.receive()
                        if message == ServerToClientMessage.PeerEndpoints(expected):
                            return

            await endpoints_of(a, [record_b])
            await endpoints_of(b, [record_a])
            extras = [m for m in a.received if isinstance(m, ServerToClientMessage.RunExtras)]
            assert len(extras) == 1
            assert extras[0].value.backup_data_locations == backups
            assert extras[0].value.run_identity == server.run_identity
            assert len(server.run_identity) == 32
            # the client that never spoke an extension only ever gets upstream's variant
            for _ in range(5):
                await upstream.next_coordinator()
            assert all(isinstance(m, ServerToClientMessage.Coordinator) for m in upstream.received)
            # a disconnect withdraws the record from the others
            await b.conn.aclose()
            await endpoints_of(a, [])
            for client in (a, upstream):
                await client.conn.aclose()

    trio.run(main)


def test_backend_follows_the_run_and_reports_a_lost_server() -> None:
    async def main() -> None:
        key = SecretKey.generate()
        async with trio.open_nursery() as nursery:
            server_scope = trio.CancelScope()

            async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with server_scope:
                    await serve_coordinator(
                        quick_coordinator(init_min_clients=1),
                        fast_options(),
                        task_status=task_status,
                    )

            server: CentralizedServer = await nursery.start(serve)
            async with CentralizedBackend.connect(addr(server), key, "test-run") as backend:
                assert backend.extensions_enabled
                assert backend.backup_data_locations == []
                assert backend.run_identity() == server.run_identity
                state = await backend.wait_for_new_state()
                assert state.run_id == "test-run"
                warmup = await wait_state(backend, RunState.Warmup)
                assert [c.id for c in warmup.epoch_state.clients] == [backend.identity]
                await backend.send_witness(OpportunisticData.WarmupStep(warmup_witness_for(0)))
                await wait_state(backend, RunState.RoundTrain)
                # a cancelled wait loses nothing
                with trio.move_on_after(0):
                    await backend.wait_for_new_state()
                assert (await backend.wait_for_new_state()).run_id == "test-run"
                server_scope.cancel()  # the server goes away
                with pytest.raises(BackendDisconnected), trio.fail_after(5):
                    await states_forever(backend)
                with pytest.raises(BackendDisconnected):
                    await backend.send_checkpoint(Checkpoint.Hub(HubRepo("x")))

    trio.run(main)


async def receive_forever(client: ProtocolClient) -> None:
    """Reads until the connection ends: what ends it is what the caller checks."""
    while True:
        await client.receive()


async def states_forever(backend: CentralizedBackend) -> None:
    """Waits for states until the backend fails: how it fails is what the caller checks."""
    while True:
        await backend.wait_for_new_state()


async def wait_state(backend: CentralizedBackend, state: RunState) -> Coordinator:
    with trio.fail_after(10):
        while True:
            coordinator = await backend.wait_for_new_state()
            if coordinator.run_state is state:
                return coordinator


def test_backend_waits_for_a_server_that_is_not_up_yet_and_gives_up_in_time() -> None:
    async def main() -> None:
        port = free_port()
        with pytest.raises(BackendDisconnected, match="cannot connect"), trio.fail_after(5):
            async with CentralizedBackend.connect(
                f"127.0.0.1:{port}", SecretKey.generate(), "x", connect_timeout=0.5
            ):
                pass

        async def late_server(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            await trio.sleep(0.3)
            async with open_server(quick_coordinator(), fast_options(port=port)):
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late_server)
            async with CentralizedBackend.connect(
                f"127.0.0.1:{port}", SecretKey.generate(), "test-run", connect_timeout=10
            ) as backend:
                assert (await backend.wait_for_new_state()).run_id == "test-run"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_backend_falls_back_when_the_server_is_upstreams() -> None:
    """An upstream server cannot decode the extension hello and drops the connection."""
    from psyche.core.serde import DataEnum, variant
    from psyche.transport import Message, PostcardCodec, TcpServer

    class UpstreamClientMessage(DataEnum):
        Join = variant(ClientToServerMessage.Join.payload_type)
        Witness = variant(ClientToServerMessage.Witness.payload_type)
        HealthCheck = variant(ClientToServerMessage.HealthCheck.payload_type)
        Checkpoint = variant(ClientToServerMessage.Checkpoint.payload_type)

    class UpstreamServerMessage(DataEnum):
        Coordinator = variant(Coordinator)

    async def main() -> None:
        async with TcpServer.start(
            to_server=PostcardCodec(UpstreamClientMessage),
            to_client=PostcardCodec(UpstreamServerMessage),
            host="127.0.0.1",
        ) as tcp:
            joined = trio.Event()
            coordinator = quick_coordinator()

            async def serve() -> None:
                async for event in tcp:
                    if isinstance(event, Message):
                        assert isinstance(event.message, UpstreamClientMessage.Join)
                        joined.set()
                        tcp.send_to(event.client, UpstreamServerMessage.Coordinator(coordinator))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                address = f"127.0.0.1:{tcp.local_addr[1]}"
                async with CentralizedBackend.connect(
                    address, SecretKey.generate(), "test-run"
                ) as backend:
                    await joined.wait()
                    assert not backend.extensions_enabled
                    assert backend.connections == 1
                    assert (await backend.wait_for_new_state()).run_id == "test-run"
                    await backend.publish_endpoint(b"ignored: the server cannot relay")
                nursery.cancel_scope.cancel()

    trio.run(main)


# ---- hosting the data ------------------------------------------------------------------------


def test_hosts_the_data_for_the_runs_clients_only(tmp_path: Path) -> None:
    coordinator, data = hosted(tmp_path)
    data_addr = coordinator.model.value.data_location.value  # type: ignore[attr-defined]

    async def main() -> None:
        async with open_server(coordinator, fast_options(data_config=data)) as server:
            member, stranger = SecretKey.generate(), SecretKey.generate()
            async with CentralizedBackend.connect(addr(server), member, "test-run") as backend:
                await wait_state(backend, RunState.Warmup)
                fetcher = await DataProviderTcpClient.connect(data_addr, member)
                batch = await fetcher.get_batch(BatchId(0, 3))
                assert batch.shape == (4, 32)
                assert batch.tolist() == data.open_provider().read_batch(BatchId(0, 3)).tolist()
                await fetcher.aclose()
                outsider = await DataProviderTcpClient.connect(data_addr, stranger)
                with pytest.raises(DataProviderError, match="NotInThisRound"):
                    await outsider.get_batch(BatchId(0, 0))
                await outsider.aclose()

    trio.run(main)


@pytest.mark.parametrize(
    ("checkpoint", "epoch", "error"),
    [
        (Checkpoint.Ephemeral(), 0, "Ephemeral checkpoint"),
        (Checkpoint.P2P(HubRepo("repo")), 0, "P2P checkpoint"),
        (Checkpoint.P2P(HubRepo("repo")), 3, None),  # a resumed run
        (Checkpoint.Hub(HubRepo(str(REPO / "configs/tiny-cpu/model")[:64])), 0, None),
        (Checkpoint.Dummy(HubRepo("")), 0, None),
    ],
)
def test_checkpoint_checks(checkpoint: Checkpoint, epoch: int, error: str | None) -> None:
    coordinator = quick_coordinator()
    coordinator.model.value.checkpoint = checkpoint  # type: ignore[attr-defined]
    coordinator.progress.epoch = epoch
    if error is None:
        check_checkpoint_for_hosting(coordinator, download=False)
    else:
        with pytest.raises(ServerStartError, match=error):
            check_checkpoint_for_hosting(coordinator, download=False)


def test_hosting_needs_a_data_config_and_its_data(tmp_path: Path) -> None:
    coordinator, data = hosted(tmp_path)

    async def start(options: Any) -> None:
        async with open_server(coordinator.copy(), options):
            pass

    with pytest.raises(ServerStartError, match="no --data-config passed"):
        trio.run(start, fast_options())
    (tmp_path / "data" / "pydoc-topics.ds").unlink()
    with pytest.raises(ServerStartError, match="cannot open the training data"):
        trio.run(start, fast_options(data_config=data))
    coordinator.model.value.data_location = LLMTrainingDataLocation.Server("nonsense")  # type: ignore[attr-defined]
    with pytest.raises(ServerStartError, match="Failed to parse training data server URL"):
        trio.run(start, fast_options(data_config=data))


# ---- saving and resuming -----------------------------------------------------------------------


def test_saves_at_epoch_end_and_on_exit_then_resumes(tmp_path: Path) -> None:
    saves = tmp_path / "saves"
    keys = [SecretKey.generate() for _ in range(2)]

    async def first_run() -> Coordinator:
        options = fast_options(save_state_dir=saves)
        async with open_server(quick_coordinator(), options) as server:
            early = [await ProtocolClient.connect(addr(server)) for _ in range(2)]
            for client in early:
                await client.join("test-run")
            # an epoch without witnesses: everyone withdrawn, it still ends (upstream); the
            # withdrawn clients stay kicked while the old epoch names them (upstream quirk 14)
            await early[0].wait_for(lambda s: s.progress.epoch == 1, timeout=20)
            assert len(server.saved) == 1
            assert server.saved[0].exists()
            # a second epoch with other clients; stop the server in its first round
            a, b = [await ProtocolClient.connect(addr(server), k) for k in keys]
            for client in (a, b):
                await client.join("test-run")
            state = await a.wait_for(lambda s: s.run_state is RunState.Warmup)
            index = [c.id for c in state.epoch_state.clients].index(a.identity)
            await a.send(ClientToServerMessage.Witness(OpportunisticData.WarmupStep(
                warmup_witness_for(index)
            )))  # fmt: skip
            live = await a.wait_for(lambda s: s.run_state is RunState.RoundTrain)
            for client in (*early, a, b):
                await client.conn.aclose()
        assert len(server.saved) == 2  # the epoch end and the exit
        return live

    live = trio.run(first_run)
    saved = load_state_toml(saves / (saves / "latest").read_text().strip())
    assert saved.progress.epoch == 2
    assert saved.progress.step == live.progress.step
    assert [c.id for c in saved.epoch_state.clients] == [c.id for c in live.epoch_state.clients]
    assert isinstance(saved.model.value.checkpoint, Checkpoint.P2P)  # type: ignore[attr-defined]

    async def second_run() -> None:
        from psyche.centralized.save_state import load_state

        async with open_server(load_state(saves), fast_options(save_state_dir=saves)) as server:
            assert server.coordinator.run_state is RunState.WaitingForMembers
            assert server.coordinator.progress == saved.progress
            a, b = [await ProtocolClient.connect(addr(server), k) for k in keys]
            for client in (a, b):
                await client.join("test-run")
            state = await a.wait_for(lambda s: s.run_state is RunState.Warmup)
            # the same clients are back: the model stays peer to peer, the step goes on
            assert {c.id for c in state.epoch_state.clients} == {a.identity, b.identity}
            assert isinstance(state.model.value.checkpoint, Checkpoint.P2P)  # type: ignore[attr-defined]
            assert state.progress.step == saved.progress.step
            assert state.epoch_state.start_step == saved.progress.step
            for client in (a, b):
                await client.conn.aclose()

    trio.run(second_run)


def test_backend_reconnects_to_a_restarted_server(tmp_path: Path) -> None:
    saves = tmp_path / "saves"
    port = free_port()

    async def main() -> None:
        key = SecretKey.generate()
        first = trio.CancelScope()
        coordinator = quick_coordinator(init_min_clients=1)

        async def serve(coordinator: Coordinator, scope: trio.CancelScope) -> None:
            with scope:
                options = fast_options(port=port, save_state_dir=saves)
                async with open_server(coordinator, options):
                    await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, coordinator, first)
            async with CentralizedBackend.connect(
                f"127.0.0.1:{port}", key, "test-run", reconnect_timeout=10
            ) as backend:
                await wait_state(backend, RunState.Warmup)
                await backend.send_witness(OpportunisticData.WarmupStep(warmup_witness_for(0)))
                before = await wait_state(backend, RunState.RoundTrain)
                relays_before, relays_changed = backend.relays, backend.relays_changed
                assert relays_before  # the server hosts a relay and names it
                first.cancel()  # the server stops (and saves)
                await trio.sleep(0.2)
                await backend.send_witness(OpportunisticData.WarmupStep(warmup_witness_for(0)))
                from psyche.centralized.save_state import load_state

                nursery.start_soon(serve, load_state(saves), trio.CancelScope())
                after = await wait_state(backend, RunState.Warmup)
                assert backend.connections == 2
                assert after.progress.step == before.progress.step
                assert after.progress.epoch == before.progress.epoch + 1
                assert [c.id for c in after.epoch_state.clients] == [backend.identity]
                # the restarted server's relay has a new identity: the backend says so
                with trio.fail_after(10):
                    await relays_changed.wait()
                assert backend.relays
                assert backend.relays != relays_before
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_hello_of_another_extensions_version_is_refused_in_one_line() -> None:
    """A client of another port version would not decode this server's `RunExtras` (nor this
    server its): it is told so and closed, not sent what it cannot read."""

    async def main() -> None:
        async with (
            open_server(quick_coordinator(init_min_clients=3), fast_options()) as server,
            await ProtocolClient.connect(addr(server)) as old,
        ):
            await old.send(ClientToServerMessage.ExtensionHello(ExtensionHello(version=1)))
            with trio.fail_after(10), pytest.raises(LoginRefused) as refused:
                await receive_forever(old)
            assert refused.value.permanent
            assert refused.value.reason.startswith(
                f"this server speaks version {EXTENSIONS_VERSION} of the port's extensions and "
                "the client version 1"
            )
            assert not any(isinstance(m, ServerToClientMessage.RunExtras) for m in old.received)

    trio.run(main)


def test_run_extras_of_another_version_end_the_client_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server of the previous port version sends `RunExtras` without its last field: the
    client says it cannot read it, once, instead of retrying a connection that cannot work."""

    async def main() -> None:
        async with open_server(quick_coordinator(init_min_clients=3), fast_options()) as server:
            send = server._send

            def as_version_1(client: bytes, message: ServerToClientMessage) -> None:
                if isinstance(message, ServerToClientMessage.RunExtras) and server.tcp:
                    body = to_bytes(message, ServerToClientMessage)[
                        :-1
                    ]  # no exact_verification_threads
                    server.tcp.send_encoded(client, encode_else(body))
                else:
                    send(client, message)

            monkeypatch.setattr(server, "_send", as_version_1)
            with trio.fail_after(30), pytest.raises(ExtensionsMismatch) as ended:
                async with CentralizedBackend.connect(
                    addr(server), SecretKey.generate(), "test-run"
                ):
                    pass
            assert "it runs another version of psyche" in str(ended.value)

    trio.run(main)
