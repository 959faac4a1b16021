"""The authenticated TCP transport (psyche.transport.tcp): upstream's four tcp.rs tests, the wire
bytes, and hostile peers that must only ever lose their own connection."""

from __future__ import annotations

import logging
import os
from typing import Annotated

import pytest
import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.core.serde import DataEnum, FixedBytes, from_bytes, struct, to_bytes, variant
from psyche.core.signed_message import SignedMessage
from psyche.transport.tcp import (
    MAX_REFUSED_REASON,
    REFUSED,
    ConnectionClosed,
    ConnectionLimits,
    Disconnected,
    FramedStream,
    FrameTooLarge,
    Message,
    PostcardCodec,
    TcpClient,
    TcpProtocolError,
    TcpServer,
    decode_refused,
    encode_challenge_response,
    encode_else,
    encode_refused,
    parse_address,
    split_envelope,
)

from ..polling import poll_until
from .conftest import CODECS, ToClient, ToServer

pytestmark = pytest.mark.anyio


def start_server(**kwargs):
    return TcpServer.start(host="127.0.0.1", port=0, **CODECS, **kwargs)


def addr(server: TcpServer) -> str:
    return f"127.0.0.1:{server.local_addr[1]}"


async def connect(server: TcpServer, key: SecretKey | None = None, **kwargs) -> TcpClient:
    return await TcpClient.connect(addr(server), key or SecretKey.generate(), **CODECS, **kwargs)


async def wait_for(predicate, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        await poll_until(predicate, 0.005)


class RawPeer:
    """A hand-driven client socket for sending what a well-behaved client never would."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.framed = FramedStream(stream, max_receive_frame=1 << 20, max_send_frame=1 << 30)

    @classmethod
    async def open(cls, server: TcpServer) -> RawPeer:
        return cls(await trio.open_tcp_stream("127.0.0.1", server.local_addr[1]))

    async def challenge(self) -> bytes:
        frame = await self.framed.receive()
        assert frame is not None
        assert len(frame) == 33
        assert frame[0] == 0
        return frame[1:]

    async def handshake(self, key: SecretKey) -> None:
        await self.framed.send(encode_challenge_response(key, await self.challenge()))

    async def closed_by_server(self) -> bool:
        with trio.fail_after(2):
            try:
                return await self.stream.receive_some(1) == b""
            except trio.BrokenResourceError:
                return True


# -- upstream's tests


async def test_tcp_handshake_uses_only_the_key() -> None:
    async with start_server() as server:
        key = SecretKey.generate()
        client = await connect(server, key)
        assert client.identity == key.public_key
        await wait_for(lambda: key.public_key in server.connected_clients())
        await client.aclose()


async def test_multiple_clients() -> None:
    async with start_server() as server:
        k1, k2 = SecretKey.generate(), SecretKey.generate()
        c1, c2 = await connect(server, k1), await connect(server, k2)
        await wait_for(lambda: len(server.connected_clients()) == 2)
        assert set(server.connected_clients()) == {k1.public_key, k2.public_key}
        await c1.aclose()
        await c2.aclose()


async def test_challenge_rejects_invalid_signature() -> None:
    async with start_server() as server:
        peer = await RawPeer.open(server)
        await peer.challenge()
        bad = encode_challenge_response(SecretKey.generate(), bytes([0xFF] * 32))  # wrong challenge
        await peer.framed.send(bad)
        await trio.sleep(0.1)
        assert server.connected_clients() == []
        assert await peer.closed_by_server()


async def test_message_exchange_after_handshake() -> None:
    async with start_server() as server:
        key = SecretKey.generate()
        client = await connect(server, key)
        await client.send(ToServer.Ping("hiiii"))
        assert await server.next() == Message(key.public_key, ToServer.Ping("hiiii"))
        server.send_to(key.public_key, ToClient.Pong("hewwo :3"))
        assert await client.receive() == ToClient.Pong("hewwo :3")
        await client.aclose()
        assert await server.next() == Disconnected(key.public_key)


# -- wire bytes


async def test_handshake_bytes() -> None:
    # Test key of the local testnet: secret = 31 zero bytes then 0x01.
    key = SecretKey.from_bytes(bytes(31) + b"\x01")
    assert (
        key.public_key.hex() == "4cb5abf6ad79fbf5abbccafcc269d85cd2651ed4b885b5869f241aedf0a5ba29"
    )
    challenge = bytes(range(32))
    response = encode_challenge_response(key, challenge)
    assert response[:3] == bytes([0x00, 0x81, 0x01])
    assert len(response) == 3 + 129
    signed = response[3:]
    assert signed[:32] == key.public_key
    assert signed[32] == 0x20
    assert signed[33:65] == challenge
    signer, decoded = SignedMessage.verify_and_decode(signed, Annotated[bytes, FixedBytes(32)])
    assert signer == key.public_key
    assert decoded == challenge
    assert response == encode_challenge_response(key, challenge)  # ed25519 is deterministic
    async with start_server() as server:
        peer = await RawPeer.open(server)
        header = await peer.stream.receive_some(4)
        assert header == (33).to_bytes(4, "big")
    frame = to_bytes(ToServer.Ping("hi"), ToServer)
    assert frame == bytes([0, 2]) + b"hi"
    assert from_bytes(frame, ToServer) == ToServer.Ping("hi")


@struct(frozen=True)
class Join:
    run_id: str


class CentralizedToServer(DataEnum):
    """The shape of the centralized protocol's first message (not this module's, but it rides on
    these frames: upstream's documented bytes check the framing end to end)."""

    Join = variant(Join)


async def test_join_frame_bytes_through_the_client_framing() -> None:
    left, right = trio.testing.memory_stream_pair()
    framed = FramedStream(left, max_receive_frame=1 << 20, max_send_frame=1 << 20)
    payload = PostcardCodec(CentralizedToServer).encode(CentralizedToServer.Join(Join("test")))
    await framed.send(encode_else(payload))
    assert await right.receive_some() == bytes.fromhex("0000000701000474657374")


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:20001") == ("127.0.0.1", 20001)
    assert parse_address("[::1]:5") == ("::1", 5)
    for bad in ("127.0.0.1", "host:0", "host:x", ":80"):
        with pytest.raises(ValueError, match="expected host:port"):
            parse_address(bad)


# -- hostile peers: only their own connection goes


async def test_bad_frames_close_only_that_connection(caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with start_server(limits=ConnectionLimits(handshake_timeout=0.3)) as server:
        good_key = SecretKey.generate()
        good = await connect(server, good_key)

        oversize = await RawPeer.open(server)
        await oversize.handshake(SecretKey.generate())
        await oversize.stream.send_all((8 * 1024 * 1024 + 1).to_bytes(4, "big"))
        assert await oversize.closed_by_server()

        undecodable = await RawPeer.open(server)
        await undecodable.handshake(SecretKey.generate())
        await undecodable.framed.send(bytes([1, 0, 0xFF]))  # Ping with a 255-byte string, 0 sent
        assert await undecodable.closed_by_server()

        second_response = await RawPeer.open(server)
        key = SecretKey.generate()
        challenge = await second_response.challenge()
        await second_response.framed.send(encode_challenge_response(key, challenge))
        await second_response.framed.send(encode_challenge_response(key, challenge))
        assert await second_response.closed_by_server()

        wrong_first = await RawPeer.open(server)
        await wrong_first.challenge()
        await wrong_first.framed.send(bytes([1, 2]) + b"hi")  # Else before the handshake
        assert await wrong_first.closed_by_server()

        silent = await RawPeer.open(server)
        await silent.challenge()
        assert await silent.closed_by_server()  # handshake timeout

        await good.send(ToServer.Ping("still here"))
        events = []
        with trio.fail_after(2):
            while not any(isinstance(e, Message) for e in events):
                events.append(await server.next())
        assert Message(good_key.public_key, ToServer.Ping("still here")) in events
        assert server.connected_clients() == [good_key.public_key]
        await good.aclose()
    for text in (
        "exceeds the limit",
        "dropping connection",
        "Unexpected challenge message",
        "expected ChallengeResponse",
        "handshake timed out",
    ):
        assert text in caplog.text


async def test_frames_split_into_single_bytes_still_arrive() -> None:
    async with start_server() as server:
        key = SecretKey.generate()
        peer = await RawPeer.open(server)
        challenge = await peer.challenge()
        data = encode_challenge_response(key, challenge)
        frame = len(data).to_bytes(4, "big") + data
        payload = bytes([1]) + to_bytes(ToServer.Ping("slow"), ToServer)
        frame += len(payload).to_bytes(4, "big") + payload
        for b in frame:
            await peer.stream.send_all(bytes([b]))
        assert await server.next() == Message(key.public_key, ToServer.Ping("slow"))


async def test_reconnect_with_the_same_key_replaces_the_old_connection() -> None:
    async with start_server() as server:
        key = SecretKey.generate()
        old = await connect(server, key)
        await wait_for(lambda: server.connected_clients() == [key.public_key])
        new = await connect(server, key)
        await trio.sleep(0.05)
        await old.aclose()
        await trio.sleep(0.05)
        # The old connection's end must not unregister the new one (upstream removes by key),
        # nor report the client as gone.
        assert server.connected_clients() == [key.public_key]
        server.send_to(key.public_key, ToClient.Pong("to the new one"))
        assert await new.receive() == ToClient.Pong("to the new one")
        await new.send(ToServer.Ping("new"))
        assert await server.next() == Message(key.public_key, ToServer.Ping("new"))
        await new.aclose()
        assert await server.next() == Disconnected(key.public_key)


async def test_broadcast_send_limits_and_unknown_clients() -> None:
    async with start_server(max_send_frame=1000) as server:
        clients = [await connect(server) for _ in range(3)]
        await wait_for(lambda: len(server.connected_clients()) == 3)
        server.broadcast(ToClient.Pong("all"))
        for c in clients:
            assert await c.receive() == ToClient.Pong("all")
        server.send_to(SecretKey.generate().public_key, ToClient.Pong("nobody"))  # no-op
        with pytest.raises(FrameTooLarge):
            server.broadcast(ToClient.Pong("x" * 2000))
        server.broadcast(ToClient.Pong("after"))
        for c in clients:
            assert await c.receive() == ToClient.Pong("after")
            await c.aclose()


async def test_client_limits_and_server_going_away() -> None:
    async with start_server(max_send_frame=1 << 20) as server:
        key = SecretKey.generate()
        client = await connect(server, key, max_frame=150)  # the limit applies both ways
        await wait_for(lambda: server.connected_clients() == [key.public_key])
        server.send_to(key.public_key, ToClient.Pong("y" * 200))
        with pytest.raises(FrameTooLarge):
            await client.receive()
        await client.aclose()
        other = await connect(server)
    with pytest.raises(ConnectionClosed):
        await other.receive()
    await other.aclose()


async def test_client_that_never_reads_is_dropped(caplog) -> None:
    limits = ConnectionLimits(max_queued_frames=2)
    async with start_server(limits=limits, max_send_frame=1 << 20) as server:
        key = SecretKey.generate()
        client = await connect(server, key)
        await wait_for(lambda: server.connected_clients() == [key.public_key])
        big = ToClient.Pong("z" * 500_000)
        with trio.fail_after(5):
            while server.connected_clients():
                server.send_to(key.public_key, big)
                await trio.sleep(0.001)
        assert "is not reading" in caplog.text
        await client.aclose()


async def test_receive_is_cancel_safe() -> None:
    left, right = trio.testing.memory_stream_pair()
    writer = FramedStream(left, max_receive_frame=100, max_send_frame=100)
    reader = FramedStream(right, max_receive_frame=100, max_send_frame=100)
    await left.send_all(b"\x00\x00\x00\x05he")
    with trio.move_on_after(0.05):
        await reader.receive()
    await left.send_all(b"llo")
    assert await reader.receive() == b"hello"
    await writer.send(b"again")
    assert await reader.receive() == b"again"
    await left.aclose()
    assert await reader.receive() is None
    with pytest.raises(FrameTooLarge):
        await writer.send(bytes(101))
    a, b = trio.testing.memory_stream_pair()
    half = FramedStream(b, max_receive_frame=100, max_send_frame=100)
    await a.send_all(b"\x00\x00\x00\x09abc")
    await a.aclose()
    with pytest.raises(TcpProtocolError, match="closed inside a frame"):
        await half.receive()


async def test_large_frames_are_received_in_place_and_cancel_safely() -> None:
    """Frames above DIRECT_RECEIVE_BYTES go straight into their own buffer on a socket; a
    receive cancelled halfway loses nothing, and frames around it stay intact."""
    from psyche.transport.tcp import DIRECT_RECEIVE_BYTES

    left, right = trio.socket.socketpair()
    writer = trio.SocketStream(left)
    reader = FramedStream(trio.SocketStream(right), max_receive_frame=1 << 24, max_send_frame=0)
    big = os.urandom(3 * DIRECT_RECEIVE_BYTES + 17)
    small = b"tail"
    stream = len(big).to_bytes(4, "big") + big + len(small).to_bytes(4, "big") + small
    half = 4 + len(big) // 2
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send_all, stream[:half])
            with trio.move_on_after(0.3):
                await reader.receive()  # takes half the frame, then waits: cancelled
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send_all, stream[half:])
            got = await reader.receive()
            assert isinstance(got, bytearray)
            assert got == big
            assert await reader.receive() == small
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.send_all, len(big).to_bytes(4, "big") + big[:1000])
        await writer.aclose()
        with pytest.raises(TcpProtocolError, match="closed inside a frame"):
            await reader.receive()


def test_a_refusal_frame_carries_its_reason_within_its_cap() -> None:
    frame = encode_refused("key 00ab is not allowed", permanent=True)
    tag, payload = split_envelope(frame)
    assert tag == REFUSED
    refused = decode_refused(payload)
    assert (refused.reason, refused.permanent) == ("key 00ab is not allowed", True)
    assert not decode_refused(split_envelope(encode_refused("full", permanent=False))[1]).permanent
    # the reason is cut at the cap, never longer
    long = encode_refused("x" * (MAX_REFUSED_REASON + 1), permanent=False)
    assert len(long) == 2 + MAX_REFUSED_REASON
    assert decode_refused(split_envelope(long)[1]).reason == "x" * MAX_REFUSED_REASON
    # malformed: empty, a permanence byte that is not 0/1, a reason one past the cap
    for bad in (b"", b"\x02why", b"\x00" + b"x" * (MAX_REFUSED_REASON + 1)):
        with pytest.raises(TcpProtocolError):
            decode_refused(memoryview(bad))
