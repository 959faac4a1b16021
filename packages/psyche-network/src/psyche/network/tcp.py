"""Authenticated, length-delimited TCP on trio (upstream `shared/network/src/tcp.rs`).

Used by the centralized coordinator and by the TCP data server. Wire format, as upstream:

* frames: a 4-byte big-endian payload length, then the payload. A peer's frame above the
  receiver's limit (8 MiB on the server, 64 MiB on the client, both configurable) is an error.
* server to client: postcard `enum { Challenge([u8; 32]) = 0, Else(T) = 1 }`;
  client to server: postcard `enum { ChallengeResponse(Vec<u8>) = 0, Else(T) = 1 }`.
* handshake: the server sends 32 random bytes; the client answers with
  `SignedMessage<[u8; 32]>` of them (`from` 32 bytes ‖ varint 32 ‖ challenge ‖ 64-byte ed25519
  signature = 129 bytes); the connection's identity is the signer's public key.

The envelope enums are written by hand (a varint tag, then the payload) rather than as serde
enums over `T`, because payloads go through a pluggable `Codec`: the data server encodes its
token arrays with a vectorized postcard codec that the generic serde walk could not match for
speed. `PostcardCodec(T)` is the serde encoding and the default everywhere else.

Hostile input never takes the server down: an oversized or undecodable frame, a bad signature,
a late second `ChallengeResponse` or a handshake that times out closes that one connection and
is logged, and the server keeps serving everyone else.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import trio

from psyche.core.identity import SecretKey
from psyche.core.serde import FixedBytes, PostcardError, decode_varint, from_bytes, to_bytes
from psyche.network.signed_message import SignedMessage, SignedMessageError

log = logging.getLogger(__name__)

T = TypeVar("T")
ToServer = TypeVar("ToServer")
ToClient = TypeVar("ToClient")

SERVER_MAX_FRAME_LENGTH = 8 * 1024 * 1024  # tokio-util LengthDelimitedCodec default
CLIENT_MAX_FRAME_LENGTH = 64 * 1024 * 1024  # upstream MAX_FRAME_LENGTH
CHALLENGE_LENGTH = 32
HANDSHAKE_TIMEOUT = 10.0  # seconds; upstream waits forever
SEND_QUEUE_LENGTH = 1024
DIRECT_RECEIVE_BYTES = 256 * 1024  # frames this large are received straight into their buffer

# Variant indices of the envelope enums.
CHALLENGE = 0
CHALLENGE_RESPONSE = 0
ELSE = 1

_ELSE_TAG = bytes([ELSE])
_CHALLENGE_TYPE = FixedBytes[CHALLENGE_LENGTH]


class TcpProtocolError(Exception):
    """A peer broke the protocol (bad frame, bad handshake, unexpected message)."""


class FrameTooLarge(TcpProtocolError):
    pass


class ConnectionClosed(Exception):
    """The other side closed the connection."""


class Codec(Protocol[T]):
    """Bytes of a message payload; `decode` raises ValueError (e.g. PostcardError) on bad input.

    `decode` gets a read-only view into the received frame (no copy); a decoder that keeps it
    beyond the call keeps the frame alive, which is safe: nothing reuses the frame's buffer.
    """

    def encode(self, value: T) -> bytes: ...

    def decode(self, data: memoryview) -> T: ...


@dataclass(frozen=True)
class PostcardCodec(Generic[T]):
    """The serde postcard encoding of type `tp` (upstream's `Networkable`)."""

    tp: Any

    def encode(self, value: T) -> bytes:
        return to_bytes(value, self.tp)

    def decode(self, data: bytes | memoryview) -> T:
        return from_bytes(data, self.tp)


# --------------------------------------------------------------------------------------------
# Framing


class FramedStream:
    """Length-delimited frames over a trio stream.

    `receive` is cancel-safe: bytes already read stay buffered, so a cancelled call loses nothing
    and the next call continues the same frame. On a socket, a large frame is received straight
    into its own buffer (no intermediate copies).
    """

    def __init__(
        self, stream: trio.abc.Stream, *, max_receive_frame: int, max_send_frame: int
    ) -> None:
        self._stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._buf = bytearray()
        self._frame: bytearray | None = None  # a large frame being received in place
        self._filled = 0
        self.max_receive_frame = max_receive_frame
        self.max_send_frame = max_send_frame
        self._send_lock = trio.Lock()

    async def receive(self) -> bytes | bytearray | None:
        """The next frame's payload, or None when the peer closed between frames."""
        buf = self._buf
        while True:
            if self._frame is not None:
                frame = self._frame
                if self._filled == len(frame):
                    self._frame = None
                    return frame
                assert self._socket is not None
                with memoryview(frame) as view:
                    got = await self._socket.recv_into(view[self._filled :])
                if not got:
                    raise TcpProtocolError(
                        f"connection closed inside a frame ({4 + self._filled} bytes)"
                    )
                self._filled += got
                continue
            if len(buf) >= 4:
                length = int.from_bytes(buf[:4], "big")
                if length > self.max_receive_frame:
                    raise FrameTooLarge(
                        f"frame of {length} bytes exceeds the limit of {self.max_receive_frame}"
                    )
                if len(buf) >= 4 + length:
                    with memoryview(buf) as view:
                        frame = view[4 : 4 + length].tobytes()
                    del buf[: 4 + length]
                    return frame
                if self._socket is not None and length >= DIRECT_RECEIVE_BYTES:
                    self._frame = bytearray(length)
                    self._filled = len(buf) - 4
                    self._frame[: self._filled] = buf[4:]
                    buf.clear()
                    continue
                need = 4 + length - len(buf)
            else:
                need = 4 - len(buf)
            chunk = await self._stream.receive_some(min(max(need, 65536), 4 * 1024 * 1024))
            if not chunk:
                if buf:
                    raise TcpProtocolError(f"connection closed inside a frame ({len(buf)} bytes)")
                return None
            buf += chunk

    def check_size(self, payload_len: int) -> None:
        if payload_len > self.max_send_frame:
            raise FrameTooLarge(
                f"frame of {payload_len} bytes exceeds the send limit of {self.max_send_frame}"
            )

    async def send(self, payload: bytes) -> None:
        self.check_size(len(payload))
        header = len(payload).to_bytes(4, "big")
        async with self._send_lock:
            if len(payload) < 65536:
                await self._stream.send_all(header + payload)
            else:
                await self._stream.send_all(header)
                await self._stream.send_all(payload)

    async def aclose(self) -> None:
        await self._stream.aclose()


def encode_else(payload: bytes) -> bytes:
    return _ELSE_TAG + payload


def split_envelope(frame: bytes | bytearray) -> tuple[int, memoryview]:
    """(variant index, read-only view of the payload) of an envelope frame."""
    view = memoryview(frame).toreadonly()
    tag, pos = decode_varint(view, 0, 32)
    return tag, view[pos:]


# --------------------------------------------------------------------------------------------
# Handshake


def encode_challenge(challenge: bytes) -> bytes:
    return bytes([CHALLENGE]) + to_bytes(challenge, _CHALLENGE_TYPE)


def encode_challenge_response(secret_key: SecretKey, challenge: bytes) -> bytes:
    """`ChallengeResponse(SignedMessage::<[u8; 32]>::sign_and_encode(sk, challenge))`."""
    signed = SignedMessage.sign_and_encode(secret_key, challenge, _CHALLENGE_TYPE)
    return bytes([CHALLENGE_RESPONSE]) + to_bytes(signed, bytes)  # Vec<u8>: varint length + bytes


def _decode_challenge(frame: bytes | bytearray) -> bytes:
    tag, payload = split_envelope(frame)
    if tag != CHALLENGE:
        raise TcpProtocolError("Expected challenge, got something else")
    return from_bytes(payload, _CHALLENGE_TYPE)


def verify_challenge_response(frame: bytes | bytearray, challenge: bytes) -> bytes:
    """The public key that signed `challenge` in a client's first frame; raises on anything else."""
    tag, payload = split_envelope(frame)
    if tag != CHALLENGE_RESPONSE:
        raise TcpProtocolError(
            f"Invalid client-to-server message - expected ChallengeResponse, got variant {tag}"
        )
    signed = from_bytes(payload, bytes)
    signer, decoded = SignedMessage.verify_and_decode(signed, _CHALLENGE_TYPE)
    if decoded != challenge:
        raise TcpProtocolError(f"Challenge doesn't match: {decoded.hex()} != {challenge.hex()}")
    return bytes(signer)


# --------------------------------------------------------------------------------------------
# Server


@dataclass(frozen=True)
class Message(Generic[T]):
    """A message from an authenticated client."""

    client: bytes
    message: T


@dataclass(frozen=True)
class Disconnected:
    client: bytes


ClientNotification = Message[Any] | Disconnected


@dataclass(eq=False)
class _Connection:
    client: bytes
    outbox: trio.MemorySendChannel[bytes]
    cancel_scope: trio.CancelScope


class TcpServer(Generic[ToServer, ToClient]):
    """Accepts clients, authenticates them by key, and exchanges `Else` messages with them.

    Use `async with TcpServer.start(...) as server:`; the server stops when the block exits.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        to_server: Codec[ToServer],
        to_client: Codec[ToClient],
        *,
        max_receive_frame: int,
        max_send_frame: int,
        handshake_timeout: float,
        send_queue_length: int,
        events_buffer: int,
    ) -> None:
        self._nursery = nursery
        self._to_server = to_server
        self._to_client = to_client
        self._max_receive_frame = max_receive_frame
        self.max_send_frame = max_send_frame
        self._handshake_timeout = handshake_timeout
        self._send_queue_length = send_queue_length
        self._clients: dict[bytes, _Connection] = {}
        self._events_send, self._events_receive = trio.open_memory_channel[ClientNotification](
            events_buffer
        )
        self.local_addr: tuple[str, int] = ("", 0)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        *,
        to_server: Codec[ToServer],
        to_client: Codec[ToClient],
        host: str = "0.0.0.0",
        port: int = 0,
        max_receive_frame: int = SERVER_MAX_FRAME_LENGTH,
        max_send_frame: int = SERVER_MAX_FRAME_LENGTH,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        send_queue_length: int = SEND_QUEUE_LENGTH,
        events_buffer: int = 256,
    ) -> AsyncIterator[TcpServer[ToServer, ToClient]]:
        async with trio.open_nursery() as nursery:
            server = cls(
                nursery,
                to_server,
                to_client,
                max_receive_frame=max_receive_frame,
                max_send_frame=max_send_frame,
                handshake_timeout=handshake_timeout,
                send_queue_length=send_queue_length,
                events_buffer=events_buffer,
            )
            listeners = await trio.open_tcp_listeners(port, host=host)
            sockname = listeners[0].socket.getsockname()
            server.local_addr = (sockname[0], sockname[1])
            log.info("Server listening on: %s:%d", *server.local_addr)
            nursery.start_soon(trio.serve_listeners, server._handle_connection, listeners)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()

    # -- API

    def connected_clients(self) -> list[bytes]:
        return list(self._clients)

    async def next(self) -> ClientNotification:
        """The next message or disconnection."""
        return await self._events_receive.receive()

    def __aiter__(self) -> AsyncIterator[ClientNotification]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ClientNotification]:
        while True:
            yield await self.next()

    def encode(self, message: ToClient) -> bytes:
        """A message's frame payload; raises FrameTooLarge if it exceeds the send limit."""
        payload = encode_else(self._to_client.encode(message))
        if len(payload) > self.max_send_frame:
            raise FrameTooLarge(
                f"message of {len(payload)} bytes exceeds the send limit of {self.max_send_frame}"
            )
        return payload

    def send_to(self, client: bytes, message: ToClient) -> None:
        """Queue a message for one client (nothing happens for an unknown client, as upstream)."""
        connection = self._clients.get(client)
        if connection is not None:
            self._enqueue(connection, self.encode(message))

    def send_encoded(self, client: bytes, payload: bytes) -> None:
        connection = self._clients.get(client)
        if connection is not None:
            self._enqueue(connection, payload)

    def broadcast(self, message: ToClient) -> None:
        payload = self.encode(message)
        for connection in list(self._clients.values()):
            self._enqueue(connection, payload)

    def _enqueue(self, connection: _Connection, payload: bytes) -> None:
        try:
            connection.outbox.send_nowait(payload)
        except trio.WouldBlock:
            log.error(
                "client %s is not reading (%d messages queued); disconnecting it",
                connection.client.hex(),
                self._send_queue_length,
            )
            connection.cancel_scope.cancel()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    # -- connections

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        framed = FramedStream(
            stream, max_receive_frame=self._max_receive_frame, max_send_frame=self.max_send_frame
        )
        peer = _peer_name(stream)
        connection: _Connection | None = None
        try:
            with trio.fail_after(self._handshake_timeout):
                challenge = secrets.token_bytes(CHALLENGE_LENGTH)
                await framed.send(encode_challenge(challenge))
                frame = await framed.receive()
                if frame is None:
                    raise TcpProtocolError("No response received")
                client = verify_challenge_response(frame, challenge)
            log.debug("Challenge response accepted from %s: %s", peer, client.hex())
            outbox, inbox = trio.open_memory_channel[bytes](self._send_queue_length)
            with trio.CancelScope() as scope:
                connection = _Connection(client, outbox, scope)
                if client in self._clients:
                    log.info(
                        "client %s reconnected; the new connection replaces the old", client.hex()
                    )
                self._clients[client] = connection
                await self._serve_client(framed, client, inbox)
        except trio.TooSlowError:
            log.warning("connection from %s: handshake timed out", peer)
        except (TcpProtocolError, SignedMessageError, PostcardError, ValueError) as e:
            who = connection.client.hex() if connection else peer
            log.warning("dropping connection from %s: %s", who, e)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            who = connection.client.hex() if connection else peer
            log.info("connection from %s ended: %s", who, e)
        except Exception:
            # A codec bug must not take the whole server down with it.
            who = connection.client.hex() if connection else peer
            log.exception("dropping connection from %s after an unexpected error", who)
        finally:
            if connection is not None:
                connection.outbox.close()
                # A connection that a reconnect replaced leaves quietly: its client is still here
                # (upstream removed the new connection's entry and reported a disconnect).
                if self._clients.get(connection.client) is connection:
                    del self._clients[connection.client]
                    # Delivered from the server's nursery, so that a full event queue never
                    # blocks this connection's cleanup.
                    self._nursery.start_soon(
                        self._events_send.send, Disconnected(connection.client)
                    )
            with trio.CancelScope(shield=True):
                await framed.aclose()

    async def _serve_client(
        self, framed: FramedStream, client: bytes, inbox: trio.MemoryReceiveChannel[bytes]
    ) -> None:
        """Read and write until either side fails; re-raise the first error unwrapped."""
        errors: list[Exception] = []
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                try:
                    await self._write_loop(framed, inbox)
                except Exception as e:
                    errors.append(e)
                nursery.cancel_scope.cancel()

            nursery.start_soon(write)
            try:
                await self._read_loop(framed, client)
            except Exception as e:
                errors.append(e)
            nursery.cancel_scope.cancel()
        if errors:
            raise errors[0]

    async def _read_loop(self, framed: FramedStream, client: bytes) -> None:
        while True:
            frame = await framed.receive()
            if frame is None:
                return
            tag, payload = split_envelope(frame)
            if tag == CHALLENGE_RESPONSE:
                raise TcpProtocolError("Unexpected challenge message")
            if tag != ELSE:
                raise TcpProtocolError(f"invalid client-to-server variant {tag}")
            message = self._to_server.decode(payload)
            await self._events_send.send(Message(client, message))

    @staticmethod
    async def _write_loop(framed: FramedStream, inbox: trio.MemoryReceiveChannel[bytes]) -> None:
        async with inbox:
            async for payload in inbox:
                await framed.send(payload)


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


# --------------------------------------------------------------------------------------------
# Client


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


class TcpClient(Generic[ToServer, ToClient]):
    """An authenticated connection to a `TcpServer`."""

    def __init__(
        self,
        framed: FramedStream,
        identity: bytes,
        to_server: Codec[ToServer],
        to_client: Codec[ToClient],
    ) -> None:
        self._framed = framed
        self.identity = identity
        self._to_server = to_server
        self._to_client = to_client

    @classmethod
    async def connect(
        cls,
        address: str,
        secret_key: SecretKey,
        *,
        to_server: Codec[ToServer],
        to_client: Codec[ToClient],
        max_frame: int = CLIENT_MAX_FRAME_LENGTH,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> TcpClient[ToServer, ToClient]:
        host, port = parse_address(address)
        stream = await trio.open_tcp_stream(host, port)
        framed = FramedStream(stream, max_receive_frame=max_frame, max_send_frame=max_frame)
        try:
            with trio.fail_after(handshake_timeout):
                frame = await framed.receive()
                if frame is None:
                    raise ConnectionClosed("Connection closed")
                challenge = _decode_challenge(frame)
                await framed.send(encode_challenge_response(secret_key, challenge))
        except BaseException:
            with trio.CancelScope(shield=True):
                await framed.aclose()
            raise
        log.info("Connected to server at: %s", address)
        return cls(framed, bytes(secret_key.public_key), to_server, to_client)

    async def send(self, message: ToServer) -> None:
        payload = encode_else(self._to_server.encode(message))
        try:
            await self._framed.send(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed(f"Connection closed: {e}") from e

    async def receive(self) -> ToClient:
        """The next message (cancel-safe: a cancelled call consumes nothing)."""
        try:
            frame = await self._framed.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed(f"Connection closed: {e}") from e
        if frame is None:
            raise ConnectionClosed("Connection closed")
        tag, payload = split_envelope(frame)
        if tag == CHALLENGE:
            raise TcpProtocolError("Unexpected challenge message")
        if tag != ELSE:
            raise TcpProtocolError(f"invalid server-to-client variant {tag}")
        return self._to_client.decode(payload)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._framed.aclose()

    async def __aenter__(self) -> TcpClient[ToServer, ToClient]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = [
    "CHALLENGE_LENGTH",
    "CLIENT_MAX_FRAME_LENGTH",
    "SERVER_MAX_FRAME_LENGTH",
    "ClientNotification",
    "Codec",
    "ConnectionClosed",
    "Disconnected",
    "FrameTooLarge",
    "FramedStream",
    "Message",
    "PostcardCodec",
    "TcpClient",
    "TcpProtocolError",
    "TcpServer",
    "encode_challenge",
    "encode_challenge_response",
    "encode_else",
    "parse_address",
    "split_envelope",
    "verify_challenge_response",
]
