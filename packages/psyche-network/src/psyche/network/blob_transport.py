"""How blob bytes move between peers, behind one small interface.

`TcpBlobTransport` is a side channel next to libp2p: a plain TCP listener speaking the
`blob_protocol` handshake (mutual ed25519 authentication against the run's allowlist) and then
raw payload bytes. py-libp2p's Noise+Yamux streams move about 100 MiB/s on these machines, a
plain socket several GiB/s; the side channel keeps blobs near socket speed while BLAKE3 keeps
their integrity. Another transport (QUIC, a relay, libp2p streams) can replace it by
implementing `BlobTransport`.

What peers can make the provider hold is bounded by `BLOB_LIMITS` (`psyche.core.connection_limits`):
before its signed request a connection holds a pending slot (the oldest is closed when they are
full) and may send two control frames of at most 1 KiB within the handshake timeout; a signed
request from a run member holds one of a capped number of serving slots while its blob is sent,
and is dropped if it stops reading for the stall timeout.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any, Protocol

import trio

from psyche.core.connection_limits import (
    Admission,
    ConnectionLimits,
    DropLog,
    Refused,
    peer_address,
)
from psyche.core.identity import SecretKey
from psyche.network import blob_protocol
from psyche.network.blob_protocol import AllowCheck, BlobLookup, ProgressFn
from psyche.network.identity import fmt_short
from psyche.network.ticket import EndpointAddr, TransportAddr, parse_host_port

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECS = 5.0
SOCKET_BUFFER_BYTES = 4 << 20
# Frames and buffered bytes do not apply here (control frames are capped at 1 KiB, blobs are
# sent from the store, never received); the connection caps and timeouts do.
BLOB_LIMITS = ConnectionLimits(
    handshake_timeout=blob_protocol.HANDSHAKE_TIMEOUT_SECS,
    max_connections=256,
    max_connections_per_address=64,
)


class BlobTransport(Protocol):
    def local_addrs(self) -> list[TransportAddr]:
        """Addresses this transport is reachable at (announced in tickets)."""
        ...

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve blobs until cancelled; `task_status.started()` once listening."""
        ...

    def can_reach(self, addr: EndpointAddr) -> bool: ...

    async def fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
        """The verified blob; raises `BlobProtocolError`, `OSError` or `trio.TooSlowError`."""
        ...


class _SocketByteStream:
    """A trio socket stream that can receive straight into a caller's buffer."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def receive_into(self, view: memoryview) -> int:
        return await self._stream.socket.recv_into(view)

    async def aclose(self) -> None:
        await self._stream.aclose()


def _tune(sock: Any) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


ServedFn = Callable[[bytes, int], None]


class TcpBlobTransport:
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
    ) -> None:
        self._identity = identity
        self._lookup = lookup
        self._allowed = allowed
        self._bind_host = bind_host
        self._port = port
        self._announce_host = announce_host or bind_host
        self._connect_timeout = connect_timeout
        self._on_served = on_served
        self._addrs: list[TransportAddr] = []
        self.limits = limits
        self.drops = DropLog(logger, "blob side channel: dropped connections")
        self._admission = Admission(limits, self.drops)

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
        return self._admission.pending

    @property
    def serving_connections(self) -> int:
        return self._admission.established

    async def _handle(self, stream: trio.SocketStream) -> None:
        _tune(stream.socket)
        conn = _SocketByteStream(stream)
        address, peer = peer_address(stream)
        limits = self.limits
        try:
            with self._admission.pending_connection(address) as pending:
                request = await blob_protocol.accept_request(
                    conn, self._identity, self._allowed, timeout=limits.handshake_timeout
                )
            if pending.cancelled_caught or request is None:
                return
            requester, digest = request
            try:
                with self._admission.established_connection(address, replacing=False):
                    sent = await blob_protocol.send_blob(
                        conn, self._lookup, digest, stall_timeout=limits.send_stall_timeout
                    )
            except Refused as e:
                self.drops.note("busy", f"blob request from {peer} refused: {e}")
                with trio.move_on_after(limits.send_stall_timeout):
                    await blob_protocol.send_frame(
                        conn, blob_protocol.Reply.Refused("busy"), blob_protocol.Reply
                    )
                return
            if sent is not None and self._on_served is not None:
                self._on_served(requester, sent)
        except trio.TooSlowError:
            self.drops.note("timeout", f"blob request from {peer} timed out", logging.INFO)
        except (blob_protocol.BlobProtocolError, trio.BrokenResourceError) as e:
            self.drops.note("bad request", f"blob request from {peer} dropped: {e}", logging.INFO)
        except OSError as e:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                logger.warning("blob request failed: %s", e)
        except Exception as e:  # one bad request must not stop the server
            logger.warning("blob request failed unexpectedly: %r", e)
        finally:
            await conn.aclose()

    def can_reach(self, addr: EndpointAddr) -> bool:
        return bool(addr.blob_addrs())

    async def fetch(
        self, provider: EndpointAddr, digest: bytes, size: int, on_progress: ProgressFn
    ) -> bytearray:
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
            conn = _SocketByteStream(stream)
            try:
                return await blob_protocol.fetch_one(
                    conn, self._identity, provider.id, digest, size, on_progress
                )
            finally:
                await conn.aclose()
        raise ConnectionError(
            f"no reachable blob address for {fmt_short(provider.id)}: {last_error}"
        )
