"""Authenticated, length-delimited TCP on trio (upstream `shared/network/src/tcp.rs`).

Used by the centralized coordinator and by the TCP data server. Wire format, as upstream:

* frames: a 4-byte big-endian payload length, then the payload. A peer's frame above the
  receiver's limit (8 MiB on the server, 64 MiB on the client, both configurable) is an error.
* server to client: postcard `enum { Challenge([u8; 32]) = 0, Else(T) = 1 }`;
  client to server: postcard `enum { ChallengeResponse(Vec<u8>) = 0, Else(T) = 1 }`.
* handshake: the server sends 32 random bytes; the client answers with
  `SignedMessage<[u8; 32]>` of them (`from` 32 bytes ‖ varint 32 ‖ challenge ‖ 64-byte ed25519
  signature = 129 bytes); the connection's identity is the signer's public key.
* port extension: a server that refuses an authenticated key (a private run's list, or its
  connection caps), or what it asked for later (`TcpServer.refuse`: a Join for a run the
  server does not serve), sends one last frame, tag 2 `Refused{permanent: u8, reason: UTF-8}`,
  before it closes, so the client can say why instead of retrying blindly. An upstream client
  reads it as an unknown variant and drops the connection, which the server closes anyway.

The envelope enums are written by hand (a varint tag, then the payload) rather than as serde
enums over `T`, because payloads go through a pluggable `Codec`: the data server encodes its
token arrays with a vectorized postcard codec that the generic serde walk could not match for
speed. `PostcardCodec(T)` is the serde encoding and the default everywhere else.

Hostile input never takes the server down: an oversized or undecodable frame, a bad signature,
a late second `ChallengeResponse` or a handshake that times out closes that one connection and
is logged (at most one line per kind and interval, `psyche.core.drop_log.DropLog`), and the
server keeps serving everyone else. Nothing a peer sends makes the server allocate more than
the bytes that actually arrive, and `ConnectionLimits` bounds how many connections, bytes and
seconds peers can make it hold (see `TcpServer`). A server whose messages have known bounds
also screens each frame before decoding it (`Screen`: its variant, its length, who sent it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import secrets
import select
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Protocol, TypeVar

import trio

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.core.serde import FixedBytes, PostcardError, decode_varint, from_bytes, to_bytes
from psyche.core.signed_message import SignedMessage, SignedMessageError
from psyche.transport.allowlist import Allowlist
from psyche.transport.connection_limits import (
    Admission,
    ByteBudget,
    ConnectionLimits,
    Refused,
    peer_address,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
ToServer = TypeVar("ToServer")
ToClient = TypeVar("ToClient")

SERVER_MAX_FRAME_LENGTH = 8 * 1024 * 1024  # tokio-util LengthDelimitedCodec default
CLIENT_MAX_FRAME_LENGTH = 64 * 1024 * 1024  # upstream MAX_FRAME_LENGTH
CHALLENGE_LENGTH = 32
HANDSHAKE_TIMEOUT = ConnectionLimits.handshake_timeout  # seconds; upstream waits forever
DIRECT_RECEIVE_BYTES = 64 * 1024  # frames this large are received straight into their buffer
FIRST_DIRECT_BYTES = 256 * 1024  # which is reserved at this size at first (or the frame's)
READ_BYTES = 64 * 1024  # smaller frames are assembled from reads of this size (or the cap)
MAX_READ_BYTES = 4 * 1024 * 1024
GROWTH = 4  # a large frame's buffer grows by this factor when full
SEND_CHUNK_BYTES = 1024 * 1024  # large frames are sent in such chunks (progress for a watchdog)

# Variant indices of the envelope enums.
CHALLENGE = 0
CHALLENGE_RESPONSE = 0
ELSE = 1
REFUSED = 2  # server to client, a port extension (module docstring)
MAX_REFUSED_REASON = 200  # bytes of the reason a refusal carries
REFUSED_SEND_TIMEOUT = 1.0

_ELSE_TAG = bytes([ELSE])
_CHALLENGE_TYPE = Annotated[bytes, FixedBytes(CHALLENGE_LENGTH)]

# The only frame a client sends before its handshake: `ChallengeResponse(Vec<u8>)` of a
# `SignedMessage<[u8; 32]>` (key, varint-prefixed challenge, signature), 132 bytes.
_SIGNED_CHALLENGE_LENGTH = len(
    to_bytes(
        SignedMessage(bytes(32), to_bytes(bytes(CHALLENGE_LENGTH), _CHALLENGE_TYPE), bytes(64))
    )
)
HANDSHAKE_FRAME_LENGTH = 1 + len(to_bytes(bytes(_SIGNED_CHALLENGE_LENGTH), bytes))


class TcpProtocolError(Exception):
    """A peer broke the protocol (bad frame, bad handshake, unexpected message)."""


class FrameTooLarge(TcpProtocolError):
    pass


class ConnectionClosed(Exception):
    """The other side closed the connection."""


class LoginRefused(ConnectionClosed):
    """The server authenticated this key and then refused it, saying why (`REFUSED`).

    `permanent`: retrying with the same key cannot help (a private run that does not list it);
    otherwise the server was full and a later attempt may get in."""

    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


def encode_refused(reason: str, *, permanent: bool) -> bytes:
    """The `REFUSED` frame: tag, permanence byte, the reason (truncated to its cap)."""
    text = reason.encode()[:MAX_REFUSED_REASON]
    return bytes([REFUSED, int(permanent)]) + text


def decode_refused(payload: memoryview) -> LoginRefused:
    if len(payload) < 1 or payload[0] > 1 or len(payload) > 1 + MAX_REFUSED_REASON:
        raise TcpProtocolError("malformed Refused frame")
    reason = bytes(payload[1:]).decode(errors="replace")
    return LoginRefused(reason, permanent=bool(payload[0]))


class Screen(Protocol):
    """Looks at a logged-in client's message before it is decoded (the server's rules of who
    may send what, and how much of it).

    Returns whether to decode the message (False: it is dropped unread); raises
    `TcpProtocolError` (or ValueError) to close the connection. Called on the server's loop
    for every message, so it must be cheap: the variant tag and the length, not the body."""

    def __call__(self, client: bytes, payload: memoryview) -> bool: ...


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
        value: T = from_bytes(data, self.tp)
        return value


# --------------------------------------------------------------------------------------------
# Framing


_bytearray_resize = ctypes.pythonapi.PyByteArray_Resize
_bytearray_resize.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
_bytearray_resize.restype = ctypes.c_int


def resize_bytearray(frame: bytearray, size: int) -> None:
    """Grow `frame` to `size` bytes without writing the new tail.

    Python can only grow a bytearray by writing into it, which would touch (and zero) every page
    of a frame before its bytes arrive; CPython's `PyByteArray_Resize` only reallocates (for a
    large block glibc moves the pages with mremap, no copy). The new tail is uninitialised: the
    socket writes it before anything reads it, and a frame is handed out only when complete.
    """
    _bytearray_resize(frame, size)


class FrameTimeout(TcpProtocolError):
    """A frame did not arrive completely within the frame timeout (a slow or stalled sender)."""


class SendStalled(TcpProtocolError):
    """A frame could not be written: the peer stopped reading for longer than the stall timeout."""


class FramedStream:
    """Length-delimited frames over a trio stream.

    `receive` is cancel-safe: bytes already read stay buffered, so a cancelled call loses nothing
    and the next call continues the same frame. Memory follows the bytes that arrive, never the
    length a header claims: small frames are assembled from reads of at most 64 KiB (at most
    the frame cap, before login a few hundred bytes); on a socket, a large frame is received
    straight into its own buffer (no intermediate copies), reserved at 256 KiB at first and
    grown fourfold each time the arriving bytes fill it: at most four times what arrived, and
    only the pages the bytes are written to are touched.

    Optional bounds (a server sets them, a client need not): `frame_timeout`, seconds within
    which a frame must complete once its first byte has arrived; `budget`, shared by a server's
    connections, for the lengths of the large frames they are receiving. For a watchdog (no
    timer on the hot path): `last_received` and `last_sent` are the `trio.current_time()` of
    the latest bytes received and of the latest chunk sent (or send begun), `sending` whether a
    send is under way.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_receive_frame: int,
        max_send_frame: int,
        frame_timeout: float | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self._stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._buf = bytearray()
        self._frame: bytearray | None = None  # a large frame being received in place
        self._frame_length = 0
        self._filled = 0
        self._held = 0  # bytes of `budget` held by `_frame`
        self._deadline: float | None = None  # when the frame under way must be complete
        self.max_receive_frame = max_receive_frame
        self.max_send_frame = max_send_frame
        self.frame_timeout = frame_timeout
        self._budget = budget
        self._send_lock = trio.Lock()
        self.last_received = self.last_sent = trio.current_time()
        self.sending = False
        self._poller: select.poll | None = None

    @property
    def last_activity(self) -> float:
        """When bytes last moved either way."""
        return max(self.last_received, self.last_sent)

    @property
    def buffered_bytes(self) -> int:
        """Bytes this stream holds for frames not yet returned (what arrived, or the buffer a
        large frame is being received into: at most four times what arrived, or 256 KiB)."""
        return len(self._frame) if self._frame is not None else len(self._buf)

    async def receive(self) -> bytes | bytearray | None:
        """The next frame's payload, or None when the peer closed between frames."""
        buf = self._buf
        while True:
            if self._frame is not None:
                if self._filled == self._frame_length:
                    return self._finish_direct()
                await self._receive_direct()
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
                    self._deadline = None
                    return frame
                if self._socket is not None and length >= DIRECT_RECEIVE_BYTES:
                    await self._start_direct(length)
                    continue
                need = 4 + length - len(buf)
            else:
                need = 4 - len(buf)
            size = min(max(need, READ_BYTES), MAX_READ_BYTES, 4 + self.max_receive_frame)
            chunk = await self._wait(self._stream.receive_some, size)
            self.last_received = trio.current_time()
            if not chunk:
                if buf:
                    raise TcpProtocolError(f"connection closed inside a frame ({len(buf)} bytes)")
                return None
            buf += chunk

    async def _wait(self, receive: Any, arg: Any) -> Any:
        """`await receive(arg)`, within the frame timeout when a frame is under way."""
        if self.frame_timeout is None or not (self._buf or self._frame is not None):
            return await receive(arg)
        if self._deadline is None:
            self._deadline = trio.current_time() + self.frame_timeout
        try:
            with trio.fail_at(self._deadline):
                return await receive(arg)
        except trio.TooSlowError:
            have = self._filled if self._frame is not None else max(len(self._buf) - 4, 0)
            raise FrameTimeout(
                f"a frame did not arrive within {self.frame_timeout:g} s "
                f"({have} bytes of it received)"
            ) from None

    async def _start_direct(self, length: int) -> None:
        # The budget counts whole frames, so that no two frames can each hold part of it while
        # waiting for more; memory itself follows the bytes that arrive.
        if self._budget is not None:
            if not self._budget.try_acquire(length):
                await self._wait(self._budget.acquire, length)
            self._held = length
        buf = self._buf
        with memoryview(buf) as view:
            frame = bytearray(view[4:])
        have = len(frame)
        buf.clear()
        # Reserved, not written: the pages past `have` are touched only as bytes arrive.
        resize_bytearray(frame, min(length, max(FIRST_DIRECT_BYTES, GROWTH * have)))
        self._frame, self._frame_length, self._filled = frame, length, have

    async def _receive_direct(self) -> None:
        frame = self._frame
        assert frame is not None
        assert self._socket is not None
        if self._filled == len(frame):
            resize_bytearray(frame, min(self._frame_length, GROWTH * len(frame)))
        with memoryview(frame) as view, view[self._filled :] as free:
            got = await self._wait(self._socket.recv_into, free)
        self.last_received = trio.current_time()
        if not got:
            raise TcpProtocolError(f"connection closed inside a frame ({4 + self._filled} bytes)")
        self._filled += got

    def _finish_direct(self) -> bytearray:
        frame = self._frame
        assert frame is not None
        self._frame = None
        self._deadline = None
        self._release()
        return frame

    def _release(self) -> None:
        if self._budget is not None:
            self._budget.release(self._held)
        self._held = 0

    def readable_now(self) -> bool:
        """Whether bytes or the peer's close are waiting to be received (no waiting)."""
        if self._buf or self._frame is not None:
            return True
        if self._socket is None:
            return False
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self._socket.fileno(), select.POLLIN)
        return bool(self._poller.poll(0))

    def check_size(self, payload_len: int) -> None:
        if payload_len > self.max_send_frame:
            raise FrameTooLarge(
                f"frame of {payload_len} bytes exceeds the send limit of {self.max_send_frame}"
            )

    async def send(self, payload: bytes | bytearray | memoryview) -> None:
        self.check_size(len(payload))
        header = len(payload).to_bytes(4, "big")
        async with self._send_lock:
            self.sending, self.last_sent = True, trio.current_time()
            try:
                if len(payload) < 65536:
                    await self._stream.send_all(header + payload)
                else:
                    await self._stream.send_all(header)
                    with memoryview(payload) as view:
                        # In chunks, so that a watchdog sees the progress of a large frame.
                        for start in range(0, len(view), SEND_CHUNK_BYTES):
                            await self._stream.send_all(view[start : start + SEND_CHUNK_BYTES])
                            self.last_sent = trio.current_time()
            finally:
                self.sending, self.last_sent = False, trio.current_time()

    async def send_eof(self) -> None:
        """Half-close: the peer reads what was sent, then the end of the stream (a close with
        unread input would reset the connection, and the peer could lose the last frame)."""
        async with self._send_lock:
            if isinstance(self._stream, trio.abc.HalfCloseableStream):
                await self._stream.send_eof()

    async def aclose(self) -> None:
        self._frame = None
        self._release()
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


class IdleTimeout(TcpProtocolError):
    """Nothing was received from or sent to an authenticated client for the idle timeout."""


@dataclass(eq=False)
class _Connection:
    client: bytes
    # Frames to send; None: the last one was a refusal, close after it.
    outbox: trio.MemorySendChannel[bytes | None]
    cancel_scope: trio.CancelScope
    queued_bytes: int = 0
    # Refused (`TcpServer.refuse`): what the client still sends is read and dropped.
    refused: bool = False


class TcpServer(Generic[ToServer, ToClient]):
    """Accepts clients, authenticates them by key, and exchanges `Else` messages with them.

    Use `async with TcpServer.start(...) as server:`; the server stops when the block exits.

    What a peer can make the server hold is bounded by `limits` (`ConnectionLimits`): before
    its handshake a connection may send one frame of `HANDSHAKE_FRAME_LENGTH` bytes within the
    handshake timeout and holds a pending slot that a newer connection may take over; after it,
    frames up to `max_receive_frame` arrive within the frame timeout into buffers that grow with
    the bytes received (large frames within a budget shared by all connections), replies
    queue up to `max_queued_bytes`, and a connection idle both ways or not reading is closed.
    With a `screen`, every message is screened before it is decoded (`Screen`).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        to_server: Codec[ToServer],
        to_client: Codec[ToClient],
        *,
        max_receive_frame: int,
        max_send_frame: int,
        limits: ConnectionLimits,
        events_buffer: int,
        allowlist: Allowlist | None = None,
        screen: Screen | None = None,
    ) -> None:
        self._nursery = nursery
        self._to_server = to_server
        self._to_client = to_client
        # Keys allowed to log in (None: any key that proves it holds itself).
        self.allowlist = allowlist
        self.screen = screen
        self._max_receive_frame = max_receive_frame
        self.max_send_frame = max_send_frame
        self.limits = limits
        self.drops = DropLog(log, "dropped connections")
        self._admission = Admission(limits, self.drops)
        self._budget = ByteBudget(limits.max_buffered_bytes)
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
        limits: ConnectionLimits | None = None,
        events_buffer: int = 256,
        allowlist: Allowlist | None = None,
        screen: Screen | None = None,
    ) -> AsyncIterator[TcpServer[ToServer, ToClient]]:
        async with trio.open_nursery() as nursery:
            server = cls(
                nursery,
                to_server,
                to_client,
                max_receive_frame=max_receive_frame,
                max_send_frame=max_send_frame,
                limits=limits or ConnectionLimits(),
                events_buffer=events_buffer,
                allowlist=allowlist,
                screen=screen,
            )
            listeners = await trio.open_tcp_listeners(port, host=host)
            sockname = listeners[0].socket.getsockname()
            server.local_addr = (sockname[0], sockname[1])
            log.info("Server listening on: %s:%d", *server.local_addr)
            nursery.start_soon(server.drops.run)
            nursery.start_soon(trio.serve_listeners, server._handle_connection, listeners)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()

    # -- API

    def connected_clients(self) -> list[bytes]:
        return list(self._clients)

    @property
    def pending_connections(self) -> int:
        """Connections accepted and not yet authenticated."""
        return self._admission.pending

    @property
    def receiving_bytes(self) -> int:
        """The lengths of the large frames being received, all connections together (what
        `limits.max_buffered_bytes` caps; their memory follows the bytes that arrived)."""
        return self._budget.used

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

    def refuse(self, client: bytes, reason: str, *, permanent: bool) -> None:
        """Send `client` one last `Refused` frame saying why (at most `MAX_REFUSED_REASON`
        bytes of it), then close its connection; what it sends meanwhile is dropped unread.
        Nothing happens for an unknown client or one refused already. The caller logs."""
        connection = self._clients.get(client)
        if connection is None or connection.refused:
            return
        connection.refused = True
        self._enqueue(connection, encode_refused(reason, permanent=permanent))
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            connection.outbox.send_nowait(None)

    def _enqueue(self, connection: _Connection, payload: bytes) -> None:
        limit = self.limits.max_queued_bytes
        if connection.queued_bytes and connection.queued_bytes + len(payload) > limit:
            self._not_reading(connection, f"{connection.queued_bytes} bytes queued")
            return
        try:
            connection.outbox.send_nowait(payload)
        except trio.WouldBlock:
            self._not_reading(connection, f"{self.limits.max_queued_frames} messages queued")
            return
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        connection.queued_bytes += len(payload)

    def _not_reading(self, connection: _Connection, why: str) -> None:
        self.drops.note(
            "not reading",
            f"client {connection.client.hex()} is not reading ({why}); disconnecting it",
            logging.ERROR,
        )
        connection.cancel_scope.cancel()

    # -- connections

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        limits = self.limits
        framed = FramedStream(
            stream,
            max_receive_frame=HANDSHAKE_FRAME_LENGTH,
            max_send_frame=self.max_send_frame,
            frame_timeout=limits.frame_timeout,
            budget=self._budget,
        )
        address, peer = peer_address(stream)
        connection: _Connection | None = None
        try:
            client = await self._handshake(framed, address, peer)
            if client is None:
                return
            if self.allowlist is not None and not self.allowlist.allowed(client):
                raise Refused(
                    f"key {client.hex()} is not allowed to log in (a private run: it is not on "
                    "the server's authorized keys)",
                    permanent=True,
                )
            replacing = client in self._clients
            with self._admission.established_connection(address, replacing=replacing):
                framed.max_receive_frame = self._max_receive_frame
                outbox, inbox = trio.open_memory_channel[bytes | None](limits.max_queued_frames)
                with trio.CancelScope() as scope:
                    connection = _Connection(client, outbox, scope)
                    old = self._clients.get(client)
                    if old is not None:
                        # One connection per key: the old one is closed (upstream left it open).
                        self.drops.note(
                            "replaced",
                            f"client {client.hex()} reconnected; the new connection replaces "
                            "the old",
                            logging.INFO,
                        )
                        old.cancel_scope.cancel()
                    self._clients[client] = connection
                    await self._serve_client(framed, connection, inbox)
        except Refused as e:
            self.drops.note("refused", f"refusing the connection from {peer}: {e}")
            # Tell the client why (it authenticated, so it is owed the reason), bounded in time.
            with (
                trio.move_on_after(REFUSED_SEND_TIMEOUT),
                contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, OSError, TcpProtocolError
                ),
            ):
                await framed.send(encode_refused(str(e), permanent=e.permanent))
        except (TcpProtocolError, SignedMessageError, PostcardError, ValueError) as e:
            who = connection.client.hex() if connection else peer
            kind = type(e).__name__ if connection else "bad handshake"
            self.drops.note(kind, f"dropping connection from {who}: {e}")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            who = connection.client.hex() if connection else peer
            self.drops.note("ended", f"connection from {who} ended: {e}", logging.INFO)
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

    async def _handshake(self, framed: FramedStream, address: str, peer: str) -> bytes | None:
        """The key of a client that proved it holds it, or None when the connection was evicted
        or timed out; raises on a broken handshake."""
        with self._admission.pending_connection(address) as pending:
            try:
                with trio.fail_after(self.limits.handshake_timeout):
                    challenge = secrets.token_bytes(CHALLENGE_LENGTH)
                    await framed.send(encode_challenge(challenge))
                    frame = await framed.receive()
                    if frame is None:
                        raise TcpProtocolError("No response received")
                    client = verify_challenge_response(frame, challenge)
            except trio.TooSlowError:
                self.drops.note(
                    "handshake timeout",
                    f"connection from {peer}: handshake timed out",
                )
                return None
        if pending.cancelled_caught:
            return None
        log.debug("Challenge response accepted from %s: %s", peer, client.hex())
        return client

    async def _serve_client(
        self,
        framed: FramedStream,
        connection: _Connection,
        inbox: trio.MemoryReceiveChannel[bytes | None],
    ) -> None:
        """Read and write until either side fails; re-raise the first error unwrapped."""
        errors: list[Exception] = []
        async with trio.open_nursery() as nursery:

            async def guard(task: Any, *args: Any) -> None:
                try:
                    await task(*args)
                except Exception as e:
                    errors.append(e)
                nursery.cancel_scope.cancel()

            nursery.start_soon(guard, self._write_loop, framed, connection, inbox)
            nursery.start_soon(guard, self._watch, framed, self.limits)
            await guard(self._read_loop, framed, connection)
        if errors:
            error = errors[0]
            errors.clear()
            try:
                raise error
            finally:
                # No cycle (error -> traceback -> this frame -> error): the connection's
                # buffers, referenced from the traceback, are freed as soon as it is handled.
                del error

    async def _read_loop(self, framed: FramedStream, connection: _Connection) -> None:
        client = connection.client
        while True:
            frame = await framed.receive()
            if frame is None:
                return
            tag, payload = split_envelope(frame)
            if tag == CHALLENGE_RESPONSE:
                raise TcpProtocolError("Unexpected challenge message")
            if tag != ELSE:
                raise TcpProtocolError(f"invalid client-to-server variant {tag}")
            if connection.refused:
                continue  # it is being told why it is closed: nothing more is heard
            if self.screen is not None and not self.screen(client, payload):
                continue  # dropped unread (the screen counted it)
            message = self._to_server.decode(payload)
            await self._events_send.send(Message(client, message))

    @staticmethod
    async def _write_loop(
        framed: FramedStream,
        connection: _Connection,
        inbox: trio.MemoryReceiveChannel[bytes | None],
    ) -> None:
        async with inbox:
            async for payload in inbox:
                if payload is None:
                    # The refusal before it is sent: let the client read it, then close (the
                    # read loop ends the connection at once when the client closes first).
                    await framed.send_eof()
                    await trio.sleep(REFUSED_SEND_TIMEOUT)
                    return
                connection.queued_bytes -= len(payload)  # in flight now: no longer queued
                await framed.send(payload)

    @staticmethod
    async def _watch(framed: FramedStream, limits: ConnectionLimits) -> None:
        """Raises when the connection has been idle both ways for the idle timeout, or a send
        has made no progress for the stall timeout (noticed within twice that: the watch
        wakes at least once a stall timeout, and no send pays for a timer)."""
        stall, idle = limits.send_stall_timeout, limits.idle_timeout
        while True:
            now = trio.current_time()
            if framed.sending and now - framed.last_sent >= stall:
                raise SendStalled(f"the peer read nothing for {stall:g} s")
            if idle is not None and now - framed.last_activity >= idle:
                raise IdleTimeout(f"nothing received or sent for {idle:g} s")
            wake = framed.last_sent + stall if framed.sending else now + stall
            if idle is not None:
                wake = min(wake, framed.last_activity + idle)
            await trio.sleep_until(wake)


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
        await self.send_encoded(self._to_server.encode(message))

    async def send_encoded(self, body: bytes) -> None:
        """A message already encoded (its codec's bytes, any bytes in a hostile test)."""
        payload = encode_else(body)
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
        if tag == REFUSED:
            raise decode_refused(payload)
        if tag != ELSE:
            raise TcpProtocolError(f"invalid server-to-client variant {tag}")
        return self._to_client.decode(payload)

    def closed_by_peer(self) -> bool:
        """Whether the server has closed this connection (or sent something) since the last
        `receive`: for a request/reply protocol, a connection that is stale before a request.
        Checks the socket without waiting."""
        return self._framed.readable_now()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._framed.aclose()

    async def __aenter__(self) -> TcpClient[ToServer, ToClient]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
