"""The frame size caps of the authenticated TCP transport, pinned at the limit and one byte past
it, for sending and receiving (tokio's LengthDelimitedCodec refuses only `length > max`).

Everything runs over real loopback TCP sockets. Each limit is checked twice: with a small cap,
and with a cap large enough that the frame takes the receive path for big frames.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from psyche.core.identity import SecretKey
from psyche.transport import (
    CLIENT_MAX_FRAME_LENGTH,
    SERVER_MAX_FRAME_LENGTH,
    ConnectionClosed,
    Disconnected,
    FramedStream,
    FrameTooLarge,
    Message,
    PostcardCodec,
    TcpClient,
    TcpServer,
    encode_else,
)

from ..polling import poll_until
from .conftest import CODECS, ToClient, ToServer

pytestmark = pytest.mark.anyio

DEADLINE = 30  # seconds: generous, for a busy 2-core machine

# A small cap, and one above the size from which frames are received straight into their buffer.
LIMITS = [1000, 1 << 20]


def test_the_caps_are_upstreams() -> None:
    assert SERVER_MAX_FRAME_LENGTH == 8 * 1024 * 1024  # tokio-util's LengthDelimitedCodec default
    assert CLIENT_MAX_FRAME_LENGTH == 64 * 1024 * 1024  # upstream tcp.rs MAX_FRAME_LENGTH


@asynccontextmanager
async def loopback_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """Both ends of one TCP connection on 127.0.0.1."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0]:
        near = await trio.open_tcp_stream("127.0.0.1", port)
        far = await listeners[0].accept()
    async with near, far:
        yield near, far


def framed(stream: trio.SocketStream, limit: int) -> FramedStream:
    return FramedStream(stream, max_receive_frame=limit, max_send_frame=limit)


def header(length: int) -> bytes:
    return length.to_bytes(4, "big")


# -- FramedStream


@pytest.mark.parametrize("limit", LIMITS)
async def test_send_of_exactly_the_limit_goes_through(limit: int) -> None:
    payload = os.urandom(limit)
    with trio.fail_after(DEADLINE):
        async with loopback_pair() as (near, far), trio.open_nursery() as nursery:
            nursery.start_soon(framed(near, limit).send, payload)
            assert await framed(far, limit).receive() == payload


@pytest.mark.parametrize("limit", LIMITS)
async def test_send_of_one_byte_past_the_limit_is_refused_and_writes_nothing(limit: int) -> None:
    with trio.fail_after(DEADLINE):
        async with loopback_pair() as (near, far):
            writer = framed(near, limit)
            with pytest.raises(FrameTooLarge):
                await writer.send(os.urandom(limit + 1))
            # Nothing of the refused frame reached the wire: the next frame is the first one.
            await writer.send(b"next")
            assert await framed(far, limit).receive() == b"next"


@pytest.mark.parametrize("limit", LIMITS)
async def test_receive_of_exactly_the_limit_is_accepted(limit: int) -> None:
    payload = os.urandom(limit)
    with trio.fail_after(DEADLINE):
        async with loopback_pair() as (near, far), trio.open_nursery() as nursery:
            # Raw bytes, so that the sender's own check plays no part.
            nursery.start_soon(near.send_all, header(limit) + payload + header(4) + b"tail")
            reader = framed(far, limit)
            assert await reader.receive() == payload
            assert await reader.receive() == b"tail"


@pytest.mark.parametrize("limit", LIMITS)
async def test_receive_of_one_byte_past_the_limit_is_refused(limit: int) -> None:
    with trio.fail_after(DEADLINE):
        async with loopback_pair() as (near, far), trio.open_nursery() as nursery:
            # The whole frame is sent, so the refusal cannot depend on when the length is checked.
            nursery.start_soon(near.send_all, header(limit + 1) + os.urandom(limit + 1))
            with pytest.raises(FrameTooLarge):
                await framed(far, limit).receive()
            nursery.cancel_scope.cancel()  # the sender may be blocked on a full socket buffer


# -- the transport's default caps, end to end


def sized(make: Callable[[str], object], codec: PostcardCodec, frame_size: int) -> object:
    """A message whose whole frame (envelope tag + postcard) is exactly `frame_size` bytes."""
    text_length = frame_size
    for _ in range(4):
        size = len(encode_else(codec.encode(make("x" * text_length))))
        if size == frame_size:
            break
        text_length -= size - frame_size
    message = make("x" * text_length)
    assert len(encode_else(codec.encode(message))) == frame_size  # the precondition
    return message


@asynccontextmanager
async def server_and_client(
    key: SecretKey, **server_limits: int
) -> AsyncIterator[tuple[TcpServer, TcpClient]]:
    async with TcpServer.start(
        to_server=CODECS["to_server"],
        to_client=CODECS["to_client"],
        host="127.0.0.1",
        port=0,
        **server_limits,
    ) as server:
        address = f"127.0.0.1:{server.local_addr[1]}"
        async with await TcpClient.connect(
            address, key, to_server=CODECS["to_server"], to_client=CODECS["to_client"]
        ) as client:
            yield server, client


async def test_server_receives_a_message_of_exactly_its_default_cap() -> None:
    key = SecretKey.generate()
    at_limit = sized(ToServer.Ping, CODECS["to_server"], SERVER_MAX_FRAME_LENGTH)
    with trio.fail_after(DEADLINE):
        async with server_and_client(key) as (server, client):
            await client.send(at_limit)
            assert await server.next() == Message(key.public_key, at_limit)


async def test_server_drops_a_client_sending_one_byte_past_its_default_cap() -> None:
    key = SecretKey.generate()
    past_limit = sized(ToServer.Ping, CODECS["to_server"], SERVER_MAX_FRAME_LENGTH + 1)
    with trio.fail_after(DEADLINE):
        async with server_and_client(key) as (server, client):
            # Within the client's own (larger) cap, so it is sent; the server refuses it.
            assert SERVER_MAX_FRAME_LENGTH + 1 <= CLIENT_MAX_FRAME_LENGTH
            with contextlib.suppress(ConnectionClosed):  # the server may hang up mid-frame
                await client.send(past_limit)
            assert await server.next() == Disconnected(key.public_key)
            assert server.connected_clients() == []


async def test_server_sends_exactly_its_default_cap_and_refuses_one_byte_more() -> None:
    key = SecretKey.generate()
    at_limit = sized(ToClient.Pong, CODECS["to_client"], SERVER_MAX_FRAME_LENGTH)
    past_limit = sized(ToClient.Pong, CODECS["to_client"], SERVER_MAX_FRAME_LENGTH + 1)
    with trio.fail_after(DEADLINE):
        async with server_and_client(key) as (server, client):
            await poll_until(lambda: key.public_key in server.connected_clients(), 0.01)
            with pytest.raises(FrameTooLarge):
                server.send_to(key.public_key, past_limit)
            with pytest.raises(FrameTooLarge):
                server.broadcast(past_limit)
            server.send_to(key.public_key, at_limit)
            assert await client.receive() == at_limit


async def test_client_refuses_to_send_one_byte_past_its_default_cap() -> None:
    key = SecretKey.generate()
    past_limit = sized(ToServer.Ping, CODECS["to_server"], CLIENT_MAX_FRAME_LENGTH + 1)
    with trio.fail_after(DEADLINE):
        async with server_and_client(key) as (server, client):
            with pytest.raises(FrameTooLarge):
                await client.send(past_limit)
            # The connection is intact: nothing of the refused frame was written.
            await client.send(ToServer.Ping("after"))
            assert await server.next() == Message(key.public_key, ToServer.Ping("after"))


async def test_client_receives_exactly_its_default_cap_and_refuses_one_byte_more() -> None:
    key = SecretKey.generate()
    at_limit = sized(ToClient.Pong, CODECS["to_client"], CLIENT_MAX_FRAME_LENGTH)
    past_limit = sized(ToClient.Pong, CODECS["to_client"], CLIENT_MAX_FRAME_LENGTH + 1)
    with trio.fail_after(DEADLINE):
        # A server allowed to send more than any client accepts.
        async with server_and_client(key, max_send_frame=CLIENT_MAX_FRAME_LENGTH + 1) as (
            server,
            client,
        ):
            await poll_until(lambda: key.public_key in server.connected_clients(), 0.01)
            server.send_to(key.public_key, at_limit)
            assert await client.receive() == at_limit
            server.send_to(key.public_key, past_limit)
            with pytest.raises(FrameTooLarge):
                await client.receive()
