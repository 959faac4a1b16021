"""What strangers and members can make a `TcpServer` hold (psyche.transport's tcp and
connection_limits): frames before login capped at the handshake's size, memory that follows the
bytes that arrive, caps on pending and logged-in connections per address and in total, and the
slow-sender, idle and stalled-reader timeouts. Real sockets on loopback; timeouts are shortened for the tests, and
every wait is bounded."""

from __future__ import annotations

import logging
import os
import socket
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.lowlevel
import trio.testing

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.transport import (
    HANDSHAKE_FRAME_LENGTH,
    SERVER_MAX_FRAME_LENGTH,
    ByteBudget,
    ConnectionLimits,
    Disconnected,
    FramedStream,
    FrameTimeout,
    Message,
    TcpClient,
    TcpServer,
    encode_challenge_response,
    encode_else,
)

from ..polling import poll_until
from .conftest import CODECS, ToClient, ToServer

pytestmark = pytest.mark.anyio

DEADLINE = 30  # seconds: generous, for a busy 2-core machine
MIB = 1 << 20


@asynccontextmanager
async def serving(**limits: float | int | None) -> AsyncIterator[TcpServer]:
    async with TcpServer.start(
        host="127.0.0.1", port=0, limits=ConnectionLimits(**limits), **CODECS
    ) as server:
        yield server


async def connect(server: TcpServer, key: SecretKey | None = None) -> TcpClient:
    address = f"127.0.0.1:{server.local_addr[1]}"
    return await TcpClient.connect(address, key or SecretKey.generate(), **CODECS)


class Peer:
    """A raw connection from a chosen loopback source address (127.0.0.0/8 is all local)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.framed = FramedStream(stream, max_receive_frame=MIB, max_send_frame=64 * MIB)

    @classmethod
    async def open(cls, server: TcpServer, source: str = "127.0.0.1") -> Peer:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", server.local_addr[1]))
        return cls(trio.SocketStream(sock))

    async def login(self, key: SecretKey | None = None) -> SecretKey:
        key = key or SecretKey.generate()
        challenge = await self.framed.receive()
        assert challenge is not None
        assert len(challenge) == 33
        await self.framed.send(encode_challenge_response(key, bytes(challenge[1:])))
        return key

    async def closed_by_server(self) -> bool:
        """True once the server has closed the connection (whatever it sent before)."""
        with trio.fail_after(DEADLINE):
            try:
                while await self.stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass
        return True

    async def aclose(self) -> None:
        await self.stream.aclose()


async def wait_until(predicate, timeout: float = DEADLINE) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        await poll_until(predicate, 0.01)


async def next_disconnect(server: TcpServer) -> Disconnected:
    with trio.fail_after(DEADLINE):
        while True:
            event = await server.next()
            if isinstance(event, Disconnected):
                return event


# -- frames before login


def test_the_pre_login_cap_is_the_challenge_response_length() -> None:
    response = encode_challenge_response(SecretKey.generate(), os.urandom(32))
    assert HANDSHAKE_FRAME_LENGTH == len(response) == 132


async def test_a_pre_login_header_claiming_8_mib_is_refused_at_once() -> None:
    async with serving() as server:
        peer = await Peer.open(server)
        await peer.framed.receive()  # the challenge
        await peer.stream.send_all(SERVER_MAX_FRAME_LENGTH.to_bytes(4, "big"))
        assert await peer.closed_by_server()
        one_past = await Peer.open(server)
        await one_past.framed.receive()
        await one_past.stream.send_all((HANDSHAKE_FRAME_LENGTH + 1).to_bytes(4, "big"))
        assert await one_past.closed_by_server()
        assert server.connected_clients() == []
        assert server.receiving_bytes == 0
        assert server.drops.counts["bad handshake"] == 2


async def test_a_flood_of_8_mib_claims_allocates_nothing_of_what_it_claims() -> None:
    """100 strangers claim 8 MiB before login and 20 fresh keys claim 8 MiB after it (sending
    1 KiB of it): the Python heap grows by far less than one claimed frame."""
    strangers, members = 100, 20
    async with serving(max_pending=200, max_pending_per_address=200) as server:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            peers = []
            for _ in range(strangers):
                peer = await Peer.open(server)
                await peer.stream.send_all(SERVER_MAX_FRAME_LENGTH.to_bytes(4, "big"))
                peers.append(peer)
            for _ in range(members):
                peer = await Peer.open(server)
                await peer.login()
                header = SERVER_MAX_FRAME_LENGTH.to_bytes(4, "big")
                await peer.stream.send_all(header + bytes([1]) + os.urandom(1023))
                peers.append(peer)
            await wait_until(lambda: len(server.connected_clients()) == members)
            for peer in peers[:strangers]:
                assert await peer.closed_by_server()
            await trio.testing.wait_all_tasks_blocked()
            grown = tracemalloc.get_traced_memory()[1] - before
            # Each logged-in claim holds one 64 KiB buffer; the old code allocated 8 MiB each.
            assert grown < 16 * MIB, grown
            # The budget counts what they claim; memory holds only what arrived.
            assert server.receiving_bytes == members * SERVER_MAX_FRAME_LENGTH
            for peer in peers:
                await peer.aclose()
            await wait_until(lambda: not server.connected_clients())
            await trio.testing.wait_all_tasks_blocked()
            assert server.receiving_bytes == 0
            assert tracemalloc.get_traced_memory()[0] - before < 2 * MIB
        finally:
            tracemalloc.stop()


# -- frames after login


async def test_a_large_frame_grows_with_the_bytes_that_arrive() -> None:
    left, right = trio.socket.socketpair()
    writer = trio.SocketStream(left)
    reader = FramedStream(trio.SocketStream(right), max_receive_frame=8 * MIB, max_send_frame=0)
    payload = os.urandom(8 * MIB)
    arrived = 300 * 1024
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.receive)
            await writer.send_all(len(payload).to_bytes(4, "big") + payload[:arrived])
            await trio.testing.wait_all_tasks_blocked()
            # 300 KiB arrived: the buffer is at most four times that, not the 8 MiB claimed.
            assert arrived <= reader.buffered_bytes <= 4 * arrived
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send_all, payload[arrived:])
            frame = await reader.receive()  # the cancelled receive lost nothing
        assert frame == payload
        assert reader.buffered_bytes == 0


async def test_the_byte_budget_makes_a_second_large_frame_wait() -> None:
    budget = ByteBudget(3 * MIB)
    pairs = [trio.socket.socketpair() for _ in range(2)]
    writers = [trio.SocketStream(a) for a, _ in pairs]
    readers = [
        FramedStream(
            trio.SocketStream(b), max_receive_frame=8 * MIB, max_send_frame=0, budget=budget
        )
        for _, b in pairs
    ]
    first, second = os.urandom(2 * MIB), os.urandom(2 * MIB)
    got: list[bytes | bytearray | None] = []

    async def receive(reader: FramedStream) -> None:
        got.append(await reader.receive())

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, readers[0])
            nursery.start_soon(receive, readers[1])
            await writers[0].send_all(len(first).to_bytes(4, "big") + first[: MIB // 2])
            nursery.start_soon(writers[1].send_all, len(second).to_bytes(4, "big") + second)
            await trio.testing.wait_all_tasks_blocked()
            # The first frame holds 2 of the 3 MiB: the second waits, holding at most a read.
            assert not got
            assert budget.used == 2 * MIB
            assert readers[1].buffered_bytes <= 64 * 1024
            await writers[0].send_all(first[MIB // 2 :])
        assert got == [first, second]
        assert budget.used == 0


async def test_a_member_trickling_a_frame_is_dropped_after_the_frame_timeout(caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with serving(frame_timeout=0.5) as server:
        peer = await Peer.open(server)
        key = await peer.login()
        await wait_until(lambda: server.connected_clients() == [key.public_key])

        async def trickle() -> None:
            await peer.stream.send_all((100).to_bytes(4, "big"))
            for _ in range(100):  # far longer than the timeout, if it never fired
                await peer.stream.send_all(b"\x01")
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            assert await next_disconnect(server) == Disconnected(key.public_key)
            nursery.cancel_scope.cancel()
        assert "did not arrive within 0.5 s" in caplog.text


async def test_a_stranger_trickling_its_handshake_is_dropped() -> None:
    async with serving(handshake_timeout=0.5) as server:
        peer = await Peer.open(server)
        await peer.framed.receive()

        async def trickle() -> None:
            with trio.move_on_after(DEADLINE):
                await peer.stream.send_all(HANDSHAKE_FRAME_LENGTH.to_bytes(4, "big"))
                for _ in range(HANDSHAKE_FRAME_LENGTH):
                    await peer.stream.send_all(b"\x00")
                    await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            assert await peer.closed_by_server()
            nursery.cancel_scope.cancel()
        assert server.drops.counts["handshake timeout"] == 1


async def test_frame_timeout_on_a_bare_framed_stream() -> None:
    left, right = trio.socket.socketpair()
    writer = trio.SocketStream(left)
    reader = FramedStream(
        trio.SocketStream(right), max_receive_frame=MIB, max_send_frame=0, frame_timeout=0.2
    )
    with trio.fail_after(DEADLINE):
        await writer.send_all(b"\x00\x00")  # half a header
        with pytest.raises(FrameTimeout):
            await reader.receive()


# -- idle and stalled connections


async def test_an_idle_member_is_dropped_and_a_served_one_is_kept() -> None:
    async with serving(idle_timeout=2.0) as server:
        idle_key, served_key = SecretKey.generate(), SecretKey.generate()
        idle, served = await connect(server, idle_key), await connect(server, served_key)
        await wait_until(lambda: len(server.connected_clients()) == 2)
        # The server writes to one of them every 0.1 s for three idle timeouts; the client only
        # reads. Write progress keeps it; the other one, with no traffic either way, is dropped.
        with trio.fail_after(DEADLINE):
            for i in range(60):
                server.send_to(served_key.public_key, ToClient.Pong(str(i)))
                assert await served.receive() == ToClient.Pong(str(i))
                await trio.sleep(0.1)
        assert server.connected_clients() == [served_key.public_key]
        assert await next_disconnect(server) == Disconnected(idle_key.public_key)
        await idle.aclose()
        await served.aclose()


async def test_a_member_that_stops_reading_is_dropped_when_sends_stall(caplog) -> None:
    caplog.set_level(logging.WARNING)
    limits = {"send_stall_timeout": 0.5, "max_queued_bytes": 256 * MIB, "max_queued_frames": 64}
    async with serving(**limits) as server:
        key = SecretKey.generate()
        client = await connect(server, key)
        await wait_until(lambda: server.connected_clients() == [key.public_key])
        big = ToClient.Pong("x" * (MIB - 16))
        for _ in range(48):  # more than loopback's socket buffers hold
            server.send_to(key.public_key, big)
        assert await next_disconnect(server) == Disconnected(key.public_key)
        assert "read nothing for 0.5 s" in caplog.text
        await client.aclose()


async def test_queued_bytes_are_capped(caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with serving(max_queued_bytes=4 * MIB) as server:
        key = SecretKey.generate()
        client = await connect(server, key)
        await wait_until(lambda: server.connected_clients() == [key.public_key])
        big = ToClient.Pong("x" * (MIB - 16))
        with trio.fail_after(DEADLINE):
            while server.connected_clients():
                server.send_to(key.public_key, big)
                await trio.lowlevel.checkpoint()
        assert "bytes queued" in caplog.text
        await client.aclose()


# -- connection caps


async def test_pending_connections_evict_the_oldest_so_members_still_log_in() -> None:
    async with serving(max_pending=4, max_pending_per_address=2) as server:
        # Per address: the third stranger from one address evicts that address's first.
        a1, a2 = await Peer.open(server), await Peer.open(server)
        await wait_until(lambda: server.pending_connections == 2)
        a3 = await Peer.open(server)
        assert await a1.closed_by_server()
        await wait_until(lambda: server.pending_connections == 2)
        # In total: strangers from two more addresses fill it; the next evicts the oldest (a2).
        others = [await Peer.open(server, "127.0.0.2"), await Peer.open(server, "127.0.0.3")]
        await wait_until(lambda: server.pending_connections == 4)
        late = await Peer.open(server, "127.0.0.4")
        assert await a2.closed_by_server()
        # A member logs in past a full pending table, evicting the oldest stranger again.
        key = SecretKey.generate()
        member = await connect(server, key)
        await wait_until(lambda: key.public_key in server.connected_clients())
        await member.send(ToServer.Ping("in"))
        with trio.fail_after(DEADLINE):
            assert await server.next() == Message(key.public_key, ToServer.Ping("in"))
        assert server.pending_connections <= 4
        assert server.drops.counts["evicted"] >= 3
        for peer in (a3, *others, late):
            await peer.aclose()
        await member.aclose()


async def test_logged_in_connections_are_capped_and_members_are_kept() -> None:
    async with serving(max_connections=3, max_connections_per_address=2) as server:
        members = [await Peer.open(server) for _ in range(2)]
        keys = [await m.login() for m in members]
        await wait_until(lambda: len(server.connected_clients()) == 2)
        # A third key from the same address is refused after its handshake...
        third = await Peer.open(server)
        await third.login()
        assert await third.closed_by_server()
        # ...one from another address gets the last slot, and a fourth key is refused.
        other = await Peer.open(server, "127.0.0.2")
        await other.login()
        await wait_until(lambda: len(server.connected_clients()) == 3)
        fourth = await Peer.open(server, "127.0.0.3")
        await fourth.login()
        assert await fourth.closed_by_server()
        assert server.drops.counts["refused"] == 2
        # A member reconnecting with its key replaces its connection even though all is full.
        again = await Peer.open(server)
        await again.login(keys[0])
        assert await members[0].closed_by_server()
        payload = encode_else(CODECS["to_server"].encode(ToServer.Ping("back")))
        await again.framed.send(payload)
        events: list[object] = []
        with trio.fail_after(DEADLINE):
            while Message(keys[0].public_key, ToServer.Ping("back")) not in events:
                events.append(await server.next())
        assert not any(isinstance(e, Disconnected) for e in events)
        connected = server.connected_clients()
        assert len(connected) == 3
        assert keys[0].public_key in connected
        assert keys[1].public_key in connected
        for peer in (*members, third, other, fourth, again):
            await peer.aclose()


# -- the log


def test_drop_log_writes_one_line_per_kind_and_a_summary(caplog) -> None:
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("test.drops")
    drops = DropLog(logger, "dropped connections", interval=10)
    for i in range(50):
        drops.note("bad handshake", f"dropping connection {i}")
    drops.note("refused", "refusing one")
    drops.flush()
    lines = [r.getMessage() for r in caplog.records if r.name == "test.drops"]
    assert lines == [
        "dropping connection 0",
        "refusing one",
        "dropped connections in the last 10 s besides those above: 49 bad handshake",
    ]
    assert drops.counts == {"bad handshake": 50, "refused": 1}
    drops.note("bad handshake", "dropping connection again")  # a new interval: shown again
    assert caplog.records[-1].getMessage() == "dropping connection again"
