"""How blob bytes move between peers: one blob protocol (`blob_protocol`), two carriers.

* **The side channel** (`TcpBlobTransport`): a plain TCP listener next to libp2p whose
  connections are encrypted and mutually authenticated by Noise (`secure_channel`), with the
  run's allowlist checked in the handshake. It moves blobs near socket speed; it needs the
  provider to be directly reachable.
* **libp2p streams** (`Libp2pBlobStreams`, protocol `/psyche/blob/0`): the same protocol on a
  stream of whatever libp2p connection joins the two peers: direct, hole punched or through a
  relay. Slower (py-libp2p's Noise and Yamux are pure Python) but it goes wherever the peer
  connection goes.

Both hand their sessions to one `BlobServer`, so what a peer can make a provider hold is the
same on either: bounded by `BLOB_LIMITS` (`psyche.transport`). Before its signed
request a side-channel connection holds a pending slot (the oldest is closed when they are full)
and must finish the Noise handshake and the request within the handshake timeout, sending at
most two handshake messages and two control frames of at most 1 KiB; each request being
answered (a blob, the model's configuration or a ticket batch) holds one of a capped number of
serving slots and is dropped if the requester stops reading for the stall timeout; between
requests a session waits at most `SESSION_IDLE_SECS` for the next one, read whole within it
(at most `blob_protocol.MAX_REQUEST_FRAME` bytes).
Which carrier a download uses is `blob_routes`'s choice.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF, StreamError, StreamReset

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.network import blob_protocol, p2p_host
from psyche.network.blob_protocol import AllowCheck, BlobLookup, BlobSession, ProgressFn
from psyche.network.identity import fmt_short, peer_id_from_public_key
from psyche.network.secure_channel import (
    PeerRefused,
    SecureChannelError,
    SecureStream,
    StaticKey,
    secure_inbound,
    secure_outbound,
)
from psyche.network.ticket import EndpointAddr, TransportAddr, parse_host_port
from psyche.transport import Admission, ConnectionLimits, Refused, peer_address

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECS = 5.0
SOCKET_BUFFER_BYTES = 4 << 20
SESSION_IDLE_SECS = 30.0
"""How long a provider keeps a session open waiting for its next request (requesters keep
idle sessions for less, `blob_routes.IDLE_SESSION_SECS`, so they close them first)."""
BLOB_PROTOCOL = "/psyche/blob/0"
LIBP2P_SEND_CHUNK = 1 << 20
# Frames and buffered bytes do not apply here (control frames are capped by `blob_protocol` per
# phase, blobs are sent from the store, never received); the connection caps and timeouts do.
BLOB_LIMITS = ConnectionLimits(
    handshake_timeout=blob_protocol.HANDSHAKE_TIMEOUT_SECS,
    max_connections=256,
    max_connections_per_address=64,
)

ServedFn = Callable[[bytes, int], None]


class BlobTransport(Protocol):
    """What the downloader needs from whatever carries blobs."""

    def can_reach(self, addr: EndpointAddr) -> bool: ...

    async def fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        """The verified blob; raises `BlobProtocolError`, `OSError` or `trio.TooSlowError`."""
        ...


def _tune(sock: Any) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ----------------------------------------------------------------------------------------------
# Serving


class BlobServer:
    """The provider's side of blob sessions, whatever carries them."""

    def __init__(
        self,
        identity: SecretKey,
        lookup: BlobLookup,
        allowed: AllowCheck,
        *,
        limits: ConnectionLimits = BLOB_LIMITS,
        on_served: ServedFn | None = None,
        idle_timeout: float = SESSION_IDLE_SECS,
        model_answers: blob_protocol.ModelAnswers | None = None,
    ) -> None:
        """`model_answers`: what `GetConfig` and `GetTickets` are answered from (the model
        this node shares; without it, either ends the session, as on a provider older than
        them)."""
        self.identity = identity
        self.model_answers = model_answers
        self.lookup = lookup
        self.allowed = allowed
        self.limits = limits
        self.on_served = on_served
        self.idle_timeout = idle_timeout
        self.drops = DropLog(logger, "blob provider: dropped connections")
        self.admission = Admission(limits, self.drops)
        self.sessions = 0
        """Authenticated sessions open now (serving or waiting for their next request)."""

    async def serve_session(
        self,
        address: str,
        peer: str,
        open_stream: Callable[[], Awaitable[blob_protocol.ByteStream]],
    ) -> None:
        """Answer the requests of one session until the requester ends it, idles past
        `idle_timeout`, or breaks the protocol (the caller closes the connection).
        `open_stream` runs first, inside the pending slot and the handshake timeout: the
        carrier's own handshake (the side channel's Noise), if any."""
        try:
            with self.admission.pending_connection(address) as pending:
                with trio.fail_after(self.limits.handshake_timeout):
                    stream = await open_stream()
                    request = await blob_protocol.accept_request(
                        stream, self.identity, self.allowed, timeout=self.limits.handshake_timeout
                    )
            if pending.cancelled_caught or request is None:
                return
            await self.serve_requests(stream, request, address, peer)
        except PeerRefused as e:
            self.drops.note("refused", f"blob side channel: {peer} refused: {e}", logging.INFO)
        except trio.TooSlowError:
            self.drops.note("timeout", f"blob request from {peer} timed out", logging.INFO)
        except (
            blob_protocol.BlobProtocolError,
            SecureChannelError,
            trio.BrokenResourceError,
            StreamError,
        ) as e:
            self.drops.note("bad request", f"blob request from {peer} dropped: {e}", logging.INFO)
        except OSError as e:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                logger.warning("blob request failed: %s", e)
        except Exception as e:  # one bad request must not stop the server
            logger.warning("blob request failed unexpectedly: %r", e)

    async def serve_requests(
        self,
        stream: blob_protocol.ByteStream,
        request: blob_protocol.Request,
        address: str,
        peer: str,
    ) -> None:
        limits = self.limits
        wanted: blob_protocol.Request | None = request
        self.sessions += 1
        try:
            while wanted is not None:
                try:
                    with self.admission.established_connection(address, replacing=False):
                        sent = await self._answer(stream, wanted.message)
                except Refused as e:
                    self.drops.note("busy", f"blob request from {peer} refused: {e}")
                    with trio.move_on_after(limits.send_stall_timeout):
                        await blob_protocol.send_frame(
                            stream, blob_protocol.Reply.Refused("busy"), blob_protocol.Reply
                        )
                    return
                if sent is not None and self.on_served is not None:
                    self.on_served(request.requester, sent)
                wanted = None
                with trio.move_on_after(self.idle_timeout):
                    wanted = await blob_protocol.next_request(stream, request)
        finally:
            self.sessions -= 1

    async def _answer(
        self, stream: blob_protocol.ByteStream, request: blob_protocol.AnyRequest
    ) -> int | None:
        """A `Get`'s blob (the bytes sent), or the answer to `GetConfig` / `GetTickets` (a
        server without `model_answers` breaks the session, as a provider older than them
        does)."""
        stall_timeout = self.limits.send_stall_timeout
        if isinstance(request, blob_protocol.Get):
            return await blob_protocol.send_blob(
                stream, self.lookup, bytes(request.hash), stall_timeout=stall_timeout
            )
        if self.model_answers is None:
            raise blob_protocol.BlobProtocolError(
                f"this provider serves no {type(request).__name__}"
            )
        await blob_protocol.send_model_answer(
            stream, self.model_answers, request, stall_timeout=stall_timeout
        )
        return None


# ----------------------------------------------------------------------------------------------
# The side channel


class TcpBlobTransport:
    """The encrypted side channel: its listener (serving through `server`) and its dialer."""

    def __init__(
        self,
        identity: SecretKey,
        lookup: BlobLookup,
        allowed: AllowCheck,
        *,
        bind_host: str,
        port: int = 0,
        announce_host: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_SECS,
        on_served: ServedFn | None = None,
        limits: ConnectionLimits = BLOB_LIMITS,
        server: BlobServer | None = None,
    ) -> None:
        self._identity = identity
        self._allowed = allowed
        self._bind_host = bind_host
        self._port = port
        self._announce_host = announce_host or bind_host
        self._connect_timeout = connect_timeout
        self._addrs: list[TransportAddr] = []
        self.static_key = StaticKey(identity)
        self.server = server or BlobServer(
            identity, lookup, allowed, limits=limits, on_served=on_served
        )

    @property
    def limits(self) -> ConnectionLimits:
        return self.server.limits

    @property
    def drops(self) -> DropLog:
        return self.server.drops

    def local_addrs(self) -> list[TransportAddr]:
        return list(self._addrs)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self._port, host=self._bind_host)
        port = listeners[0].socket.getsockname()[1]
        for listener in listeners:
            _tune(listener.socket)
        self._addrs = [TransportAddr.BlobTcp(f"{self._announce_host}:{port}")]
        logger.debug("blob side channel listening on %s:%d", self._bind_host, port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.drops.run)
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started()

    @property
    def pending_connections(self) -> int:
        return self.server.admission.pending

    @property
    def serving_connections(self) -> int:
        return self.server.admission.established

    async def _handle(self, stream: trio.SocketStream) -> None:
        _tune(stream.socket)
        address, peer = peer_address(stream)

        async def handshake() -> SecureStream:
            return await secure_inbound(stream, self.static_key, self._allowed)

        try:
            await self.server.serve_session(address, peer, handshake)
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    def can_reach(self, addr: EndpointAddr) -> bool:
        return bool(addr.blob_addrs())

    async def open_session(self, provider: EndpointAddr) -> BlobSession:
        """A Noise session to `provider`'s side channel (first address that answers); raises
        `ConnectionError` (including `PeerRefused`) or `trio.TooSlowError`."""
        last_error: Exception | None = None
        for text in provider.blob_addrs():
            try:
                host, port = parse_host_port(text)
                with trio.fail_after(self._connect_timeout):
                    stream = await trio.open_tcp_stream(host, port)
            except (OSError, ValueError, trio.TooSlowError) as e:
                last_error = e
                logger.debug("cannot connect to %s at %s: %s", fmt_short(provider.id), text, e)
                continue
            _tune(stream.socket)
            try:
                with trio.fail_after(self._connect_timeout):
                    secure = await secure_outbound(stream, self.static_key, provider.id)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                raise
            return BlobSession(secure, self._identity, provider.id)
        raise ConnectionError(
            f"no reachable blob address for {fmt_short(provider.id)}: {last_error}"
        )

    async def fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        """One blob on a session of its own."""
        session = await self.open_session(provider)
        try:
            return await session.fetch(digest, size, on_progress)
        finally:
            with trio.CancelScope(shield=True):
                await session.stream.aclose()


# ----------------------------------------------------------------------------------------------
# libp2p streams


class Libp2pByteStream:
    """A libp2p stream as a `ByteStream`."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with memoryview(data) as view:
            for start in range(0, len(view), LIBP2P_SEND_CHUNK):
                await self.stream.write(bytes(view[start : start + LIBP2P_SEND_CHUNK]))

    async def receive_into(self, view: memoryview) -> int:
        try:
            data = await self.stream.read(len(view))
        except StreamEOF:
            return 0
        except StreamReset as e:
            raise ConnectionResetError(f"stream reset: {e}") from None
        n = len(data)
        view[:n] = data
        return n

    async def aclose(self) -> None:
        await p2p_host.reset_quietly(self.stream)


ConnectFn = Callable[[bytes], Awaitable[None]]


class Libp2pBlobStreams:
    """Blob sessions on libp2p streams: `handle` serves inbound ones through `server`,
    `open_session` opens one on the connection `connect` makes sure exists."""

    def __init__(self, host: IHost, server: BlobServer, connect: ConnectFn) -> None:
        self.host = host
        self.server = server
        self._connect = connect

    async def handle(self, stream: INetStream) -> None:
        peer = await p2p_host.stream_peer(stream, self.server.allowed)
        if peer is None:
            return
        conn = Libp2pByteStream(stream)

        async def ready() -> Libp2pByteStream:
            return conn

        try:
            await self.server.serve_session(f"libp2p:{peer.hex()}", fmt_short(peer), ready)
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    def connected(self, peer: bytes) -> bool:
        return bool(self.host.get_network().get_connections(peer_id_from_public_key(peer)))

    def has_path(self, peer: bytes, path: str) -> bool:
        """Whether a `direct` (or `relayed`) connection to `peer` is open."""
        return bool(p2p_host.connections_on(self.host, peer, path))

    async def open_session(
        self, provider: bytes, *, relayed: bool = False
    ) -> tuple[BlobSession, bool]:
        """A session on a new stream to `provider`, and whether its connection is relayed;
        raises `ConnectionError` when no connection can be made or the stream is refused.
        `relayed`: on a relayed connection already open (else on the one py-libp2p prefers,
        a direct one over a relayed one)."""
        protocols = [p2p_host.protocol(BLOB_PROTOCOL)]
        try:
            on_relay = p2p_host.connections_on(self.host, provider, "relayed") if relayed else []
            if on_relay:
                stream = await p2p_host.new_stream_on(self.host, on_relay[0], protocols)
            else:
                await self._connect(provider)
                stream = await self.host.new_stream(peer_id_from_public_key(provider), protocols)
        except (LookupError, PermissionError, BaseLibp2pError, trio.TooSlowError) as e:
            raise ConnectionError(f"no libp2p stream to {fmt_short(provider)}: {e}") from e
        relayed = p2p_host.is_relayed(stream.muxed_conn)
        return BlobSession(Libp2pByteStream(stream), self.server.identity, provider), relayed


__all__ = [
    "BLOB_LIMITS",
    "BLOB_PROTOCOL",
    "CONNECT_TIMEOUT_SECS",
    "BlobServer",
    "BlobTransport",
    "Libp2pBlobStreams",
    "Libp2pByteStream",
    "TcpBlobTransport",
]
