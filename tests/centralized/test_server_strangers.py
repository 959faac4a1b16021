"""Issue 13 on a real server over loopback TCP: what strangers and spamming members get.

* a private run refuses a key it does not list right after the handshake (one frame saying
  why, then the connection is closed before it costs anything more), and takes the keys it
  lists; the start-up line says who may join; a client backend with such a key stops at once
  with that reason instead of retrying;
* non-members' Checkpoint, Witness and HealthCheck messages are not broadcast: a connected
  client receives one state per tick however many are sent;
* a joined client cannot make the server resend endpoint records or run extras by repeating
  Join, ExtensionHello or AnnounceEndpoint: the records go out at most once per tick, the hello
  is answered once per connection.
"""

from __future__ import annotations

import logging

import pytest
import trio

from psyche.centralized.client import BackendDisconnected, CentralizedBackend
from psyche.centralized.protocol import ClientToServerMessage, ExtensionHello, ServerToClientMessage
from psyche.centralized.server import open_server, who_may_join
from psyche.centralized.testing import ProtocolClient, fast_options
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.testing import quick_coordinator, warmup_witness_for
from psyche.core.identity import SecretKey
from psyche.core.tcp import LoginRefused
from psyche.network.discovery import sign_address_record
from psyche.network.ticket import EndpointAddr, TransportAddr

from .servers import addr, eventually

SPAM = 300


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
                await bad.join("test-run")
                await bad.next_coordinator()  # ... but the server says no and closes
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
            assert server.tcp is not None and server.tcp.drops.counts["refused"] == 2
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
            assert 0 < endpoints <= spans and 0 < states <= spans, (endpoints, states, spans)
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
