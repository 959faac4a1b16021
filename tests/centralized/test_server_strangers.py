"""Issue 13 on a real server over loopback TCP: what strangers and spamming members get.

* a private run refuses a key it does not list right after the handshake (one frame saying
  why, then the connection is closed before it costs anything more), and takes the keys it
  lists; the start-up line says who may join; a client backend with such a key stops at once
  with that reason instead of retrying;
* non-members' Checkpoint, Witness and HealthCheck messages are not broadcast: a connected
  client receives one state per tick however many are sent;
* a joined client cannot make the server resend endpoint records or run extras by repeating
  Join, ExtensionHello or AnnounceEndpoint: the records go out at most once per tick, the hello
  is answered once per connection;
* (issue 24) a frame longer than any message a client can legitimately send is cut off at its
  header, from a stranger or a member, and the run trains on; a login flood logs a bounded
  number of lines; a Join for another run is refused with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct

import pytest
import trio

from psyche.centralized.client import BackendDisconnected, CentralizedBackend
from psyche.centralized.protocol import (
    CLIENT_FRAME_LIMIT,
    CLIENT_MESSAGE_LIMITS,
    ClientToServerMessage,
    ExtensionHello,
    ServerToClientMessage,
)
from psyche.centralized.server import CentralizedServer, open_server, who_may_join
from psyche.centralized.testing import (
    DummyTrainer,
    ProtocolClient,
    fast_options,
    health_check_payload,
)
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.run_state import RunState
from psyche.coordinator.server_core import JOIN_LOG_BURST
from psyche.coordinator.testing import quick_coordinator, warmup_witness_for
from psyche.core.cli import single_cause
from psyche.core.identity import SecretKey
from psyche.network.discovery import sign_address_record
from psyche.network.ticket import EndpointAddr, TransportAddr
from psyche.transport import SERVER_MAX_FRAME_LENGTH, ConnectionClosed, LoginRefused

from ..timing import scale_config_timers, scaled
from .servers import addr, eventually

SPAM = 300


async def join_and_wait(client: ProtocolClient) -> None:
    """Joins the run and waits for the first state (refused: `LoginRefused`)."""
    await client.join("test-run")
    await client.next_coordinator()


async def follow_states(server: str, run_id: str) -> None:
    """A fresh backend that follows the run's states until it fails."""
    async with CentralizedBackend.connect(
        server, SecretKey.generate(), run_id, reconnect_timeout=60
    ) as backend:
        while True:
            await backend.wait_for_new_state()


def test_a_private_run_refuses_other_keys_at_login(caplog: pytest.LogCaptureFixture) -> None:
    member, stranger = SecretKey.generate(), SecretKey.generate()
    options = fast_options(authorized_keys=frozenset({member.public_key}))
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with open_server(quick_coordinator(init_min_clients=3), options) as server:
            good = await ProtocolClient.connect(addr(server), member)
            await good.join("test-run")
            await eventually(lambda: len(server.core.pending_clients) == 1)
            bad = await ProtocolClient.connect(addr(server), stranger)  # its handshake is fine
            with trio.fail_after(10), pytest.raises(LoginRefused) as refused:
                await join_and_wait(bad)  # ... but the server says no and closes
            assert refused.value.permanent
            assert f"key {stranger.public_key.hex()} is not allowed" in refused.value.reason
            # The client backend gives up at once, saying why (it would retry for 120 s on a
            # connection that is merely closed).
            with trio.fail_after(30), pytest.raises(BackendDisconnected) as stopped:
                async with CentralizedBackend.connect(addr(server), stranger, "test-run"):
                    pass
            assert "refused this client" in str(stopped.value), stopped.value
            assert "authorized keys" in str(stopped.value), stopped.value
            assert server.connected_clients() == [member.public_key]
            assert server.tcp is not None
            assert server.tcp.drops.counts["refused"] == 2
            assert [c.signer for c in server.core.pending_clients] == [member.public_key]
            await good.next_coordinator()  # the member is served as ever
            await good.conn.aclose()

    trio.run(main)
    lines = [r.getMessage() for r in caplog.records]
    assert any("private run: 1 authorized key" in line for line in lines), lines
    assert any(
        f"key {stranger.public_key.hex()} is not allowed to log in" in line for line in lines
    )
    assert who_may_join(None) == "open run: anyone may join"
    assert who_may_join(frozenset({b"a" * 32, b"b" * 32})) == "private run: 2 authorized keys"


def test_non_members_messages_are_not_broadcast() -> None:
    async def main() -> None:
        # slow ticks (0.5 s), so that a broadcast per spam message would stand out
        options = fast_options(speed=1.0)
        async with open_server(quick_coordinator(init_min_clients=3), options) as server:
            watcher = await ProtocolClient.connect(addr(server))
            await watcher.join("test-run")
            spammer = await ProtocolClient.connect(addr(server))
            await watcher.next_coordinator()
            watcher.received.clear()
            ticks = server.ticks
            messages = [
                ClientToServerMessage.Checkpoint(Checkpoint.Hub(HubRepo("spam"))),
                ClientToServerMessage.Witness(OpportunisticData.WarmupStep(warmup_witness_for(0))),
                ClientToServerMessage.HealthCheck([]),
            ]
            for i in range(SPAM):
                await spammer.send(messages[i % 3])
            await eventually(lambda: sum(server.core.ignored.counts.values()) == SPAM)
            # what the watcher got meanwhile: one state per tick, not one per spam message
            with trio.move_on_after(0.2):
                while True:
                    await watcher.receive()
            states = len(watcher.received)
            assert states <= server.ticks - ticks + 1, (states, server.ticks - ticks)
            assert server.core.ignored.counts == {
                "Checkpoint from non-members": SPAM // 3,
                "Witness from non-members": SPAM // 3,
                "HealthCheck from non-members": SPAM // 3,
            }
            for client in (watcher, spammer):
                await client.conn.aclose()

    trio.run(main)


def test_repeated_join_hello_and_endpoint_send_nothing_more() -> None:
    keys = [SecretKey.generate() for _ in range(3)]

    def record(key: SecretKey, port: int) -> bytes:
        return sign_address_record(
            key, EndpointAddr(key.public_key, [TransportAddr.BlobTcp(f"127.0.0.1:{port}")])
        )

    async def main() -> None:
        options = fast_options(speed=1.0)
        async with open_server(quick_coordinator(init_min_clients=5), options) as server:
            clients = [await ProtocolClient.connect(addr(server), k) for k in keys]
            for client, key in zip(clients, keys, strict=True):
                await client.send(ClientToServerMessage.ExtensionHello(ExtensionHello()))
                await client.join("test-run")
                await client.send(ClientToServerMessage.AnnounceEndpoint(record(key, 1000)))
            watcher, spammer = clients[0], clients[2]
            await eventually(lambda: len(server.core.pending_clients) == 3)
            # everyone has everyone's records after the next tick
            with trio.fail_after(5):
                while True:
                    message = await watcher.receive()
                    peers = isinstance(message, ServerToClientMessage.PeerEndpoints)
                    if peers and len(message.value) == 2:
                        break
            watcher.received.clear()

            async def drain(client: ProtocolClient) -> None:
                while True:
                    await client.receive()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, spammer)
                nursery.start_soon(drain, watcher)
                await trio.sleep(0.1)
                spammer.received.clear()
                watcher.received.clear()
                ticks = server.ticks
                for i in range(SPAM):
                    await spammer.join("test-run")
                    await spammer.send(ClientToServerMessage.ExtensionHello(ExtensionHello()))
                    # a new valid record each time (another port)
                    await spammer.send(
                        ClientToServerMessage.AnnounceEndpoint(record(keys[2], 2000 + i))
                    )
                await trio.sleep(1.2)
                nursery.cancel_scope.cancel()
            received = list(watcher.received)
            spans = server.ticks - ticks + 1
            endpoints = sum(isinstance(m, ServerToClientMessage.PeerEndpoints) for m in received)
            states = sum(isinstance(m, ServerToClientMessage.Coordinator) for m in received)
            assert 0 < endpoints <= spans, (endpoints, states, spans)
            assert 0 < states <= spans, (endpoints, states, spans)
            extras = [m for m in spammer.received if isinstance(m, ServerToClientMessage.RunExtras)]
            assert not extras  # answered once per connection: on its first hello, long before
            for client in clients:
                await client.conn.aclose()

    trio.run(main)


def test_an_address_the_server_cannot_bind_is_named() -> None:
    from psyche.centralized.server import ServerStartError

    async def main() -> None:
        # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
        with pytest.raises(ServerStartError, match=r"on 192\.0\.2\.1 \(--bind-address\) cannot"):
            async with open_server(quick_coordinator(), fast_options(host="192.0.2.1")):
                pass

    trio.run(main)


# ---- issue 24: what one message may hold, what a login may log, a Join for another run ----------


async def closed_unread(client: ProtocolClient) -> None:
    """Read what the server sends until it closes the connection (within 10 s)."""
    with trio.fail_after(10):
        try:
            while True:
                await client.receive()
        except (ConnectionClosed, trio.BrokenResourceError):
            return


def test_8_mib_health_checks_close_the_connection_unread_and_the_run_trains_on() -> None:
    """Issue 24, item 2: a logged-in stranger, and a member, sending 8 MiB HealthCheck frames
    (125,202 entries, ~1 s of decoding on the server's only thread before) are cut off at the
    frame header, before the frame is received or decoded; the run trains on."""
    attack = health_check_payload(SERVER_MAX_FRAME_LENGTH - 1)
    assert len(attack) + 1 <= SERVER_MAX_FRAME_LENGTH  # a frame the transport's 8 MiB cap lets in
    assert len(attack) > 100 * CLIENT_FRAME_LIMIT
    # three join; the epoch goes on with two when the third is cut off. The epoch outlasts the
    # test (it ends by cancelling), so on a starved machine the two rounds it waits for cannot
    # fall after a cooldown the dummy trainers would not rejoin from; their timers are scaled.
    coordinator = quick_coordinator(init_min_clients=3, min_clients=2, epoch_time=600)
    scale_config_timers(coordinator.config)

    async def main() -> None:
        async with open_server(coordinator, fast_options()) as server, trio.open_nursery() as n:
            address = addr(server)
            keys = [SecretKey.generate() for _ in range(3)]
            honest = [await DummyTrainer.start(n, address, "test-run", key=k) for k in keys[:2]]
            hostile = await DummyTrainer.start(n, address, "test-run", key=keys[2])
            await eventually(lambda: server.coordinator.run_state is RunState.RoundTrain, 30)
            assert len(server.coordinator.epoch_state.clients) == 3
            stranger = await ProtocolClient.connect(address)
            await stranger.next_coordinator()  # logged in
            for sender in (stranger, hostile.client):
                with contextlib.suppress(trio.BrokenResourceError, ConnectionClosed):
                    await sender.send_payload(attack)  # the server may reset it midway
            await closed_unread(stranger)
            await eventually(lambda: hostile.closed_by_server)
            # cut off at the header: nothing decoded, nothing reached the rules
            assert server.tcp is not None
            assert server.tcp.drops.counts["FrameTooLarge"] == 2
            assert "HealthCheck from non-members" not in server.core.ignored.counts
            assert "HealthCheck (too long)" not in server.core.rejected.counts
            assert server.tcp.receiving_bytes == 0
            # the run trains on: two more rounds, the honest ones in it
            step = server.coordinator.progress.step
            honest_ids = {t.identity for t in honest}
            await eventually(
                lambda: (
                    server.coordinator.progress.step >= step + 2
                    and honest_ids <= {c.id for c in server.coordinator.epoch_state.clients}
                ),
                scaled(60),
            )
            # a member's message longer than its kind can be closes its connection too
            witness_sized = b"\x01" + bytes(CLIENT_MESSAGE_LIMITS[1])
            await honest[0].client.send_payload(witness_sized)
            await eventually(lambda: honest[0].closed_by_server)
            assert server.tcp.drops.counts["FrameTooLarge"] == 3
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_login_flood_logs_a_bounded_number_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 24, item 8: 200 logins with fresh keys that join and leave (and reset their
    connection, or first announce an endpoint record signed by another key), and 30 reconnects
    of one key, log a few lines, not one or two per login."""
    logins, reconnects = 200, 30
    caplog.set_level(logging.INFO, logger="psyche")
    other = SecretKey.generate()
    not_its_own = sign_address_record(
        other, EndpointAddr(other.public_key, [TransportAddr.BlobTcp("127.0.0.1:1")])
    )

    async def login(server: CentralizedServer, key: SecretKey, reset: bool) -> None:
        client = await ProtocolClient.connect(addr(server), key)
        await client.join("test-run")
        await client.send(ClientToServerMessage.AnnounceEndpoint(not_its_own))
        if reset:  # a reset, not a close: the server sees the connection fail
            refused = server.relay.refused.counts["not its own"]
            await eventually(lambda: server.relay.refused.counts["not its own"] > refused)
            client.conn._framed._stream.socket.setsockopt(  # type: ignore[attr-defined]
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        await client.conn.aclose()

    async def main() -> None:
        options = fast_options(speed=1.0)
        async with open_server(quick_coordinator(init_min_clients=500), options) as server:
            address = addr(server)
            caplog.clear()
            with trio.fail_after(120):
                for i in range(logins):
                    await login(server, SecretKey.generate(), reset=i % 2 == 0)
                key = SecretKey.generate()
                clients = [await ProtocolClient.connect(address, key) for _ in range(reconnects)]
                await eventually(lambda: server.core.joins.counts["added pending client"] == logins)
                await eventually(lambda: not server.core.pending_clients)
                for client in clients:
                    await client.conn.aclose()
            assert server.tcp is not None
            assert server.tcp.drops.counts["replaced"] == reconnects - 1
            assert server.relay.refused.counts["not its own"] == logins

    trio.run(main)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.INFO and r.funcName != "connect"  # not the clients' own lines
    ]
    # at most a burst of each kind (8 joins, 1 of the others) before the interval's summary
    assert len(lines) <= JOIN_LOG_BURST + 4, lines
    assert sum("added pending client" in line for line in lines) == JOIN_LOG_BURST


def test_a_join_for_another_run_is_refused_with_the_reason() -> None:
    """Issue 24, item 11: a client with a wrong run id is told so (a `Refused` frame, for
    good) and stops with that one line, instead of waiting forever."""

    async def main() -> None:
        async with open_server(quick_coordinator(), fast_options()) as server:
            # the backend's failure, alone or inside its task group's exception group
            stopping = (BackendDisconnected, BaseExceptionGroup)
            with trio.fail_after(30), pytest.raises(stopping) as stopped:
                await follow_states(addr(server), "tinny")
            failure = single_cause(stopped.value)
            assert isinstance(failure, BackendDisconnected), failure
            assert str(failure) == (
                f"the coordinator at {addr(server)} refused this client: unknown run id "
                "'tinny': this server runs 'test-run'"
            )
            assert not server.core.pending_clients
            await eventually(lambda: not server.connected_clients())

    trio.run(main)
