"""The libp2p host: TCP + Noise + Yamux, keyed by the node's identity, gated by the allowlist.

py-libp2p 0.8.1 (pinned) has no peer-id connection gate (its `ConnectionGate` filters IPs), so
the swarm's `add_conn`, which runs right after the Noise handshake has authenticated the remote
peer id, is wrapped: a connection from a peer outside the allowlist is closed before any
protocol (gossip, model sharing, ping) sees it. This is upstream's `AllowlistHook` (reject
after handshake) in libp2p terms.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import PING_LENGTH
from libp2p.network.config import ConnectionConfig
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamEOF, StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from psyche.core.identity import SecretKey
from psyche.network.identity import (
    IdentityError,
    libp2p_key_pair,
    peer_id_from_public_key,
    public_key_from_peer_id,
)

logger = logging.getLogger(__name__)

AllowFn = Callable[[bytes], bool]


MAX_CONNECTIONS = 1024
DIAL_TIMEOUT_SECS = 5.0


def build_host(secret_key: SecretKey) -> IHost:
    """TCP only, Noise only, Yamux (py-libp2p's default muxer); QUIC, TLS and SECIO are off.

    Which peers to connect to is Psyche's decision (the run's clients, a few gossip bootstrap
    peers), so py-libp2p's auto-dialer, which dials every peer in its peerstore up to 150
    connections, is switched off, and pruning only starts above upstream's 1024 connections.
    """
    key_pair = libp2p_key_pair(secret_key)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
        enable_tcp=True,
        enable_quic=False,
        enable_mDNS=False,
        enable_upnp=False,
        connection_config=ConnectionConfig(
            max_connections=MAX_CONNECTIONS,
            high_watermark=MAX_CONNECTIONS,
            low_watermark=0,
            min_connections=0,
            dial_timeout=DIAL_TIMEOUT_SECS,
        ),
    )

    async def no_auto_connect() -> None:
        return None

    host.get_network().auto_connector.maybe_connect = no_auto_connect  # type: ignore[attr-defined]
    return host


def peer_key(peer_id: ID) -> bytes | None:
    """The Psyche identity behind a libp2p peer id, or None for a non-ed25519 peer."""
    try:
        return public_key_from_peer_id(peer_id)
    except IdentityError:
        return None


def install_allowlist_gate(host: IHost, allowed: AllowFn) -> None:
    swarm: Any = host.get_network()
    add_conn = swarm.add_conn

    async def gated_add_conn(muxed_conn: Any, direction: str = "unknown") -> Any:
        key = peer_key(muxed_conn.peer_id)
        if key is None or not allowed(key):
            logger.info(
                "refusing %s connection from %s: not in allowlist", direction, muxed_conn.peer_id
            )
            with contextlib.suppress(Exception):
                await muxed_conn.close()
            raise SwarmException("not in allowlist")
        return await add_conn(muxed_conn, direction)

    swarm.add_conn = gated_add_conn


class ConnectionNotifee(INotifee):
    """Forwards connection events to plain callbacks (the connection monitor)."""

    def __init__(
        self,
        on_connected: Callable[[bytes, str], None],
        on_disconnected: Callable[[bytes], None],
    ) -> None:
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        key = peer_key(conn.muxed_conn.peer_id)
        if key is not None:
            self._on_connected(key, _remote_addr(conn))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        key = peer_key(conn.muxed_conn.peer_id)
        if key is not None and not network.get_connections(conn.muxed_conn.peer_id):
            self._on_disconnected(key)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


def _remote_addr(conn: INetConn) -> str:
    try:
        remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
    except Exception:
        remote = None
    return f"{remote[0]}:{remote[1]}" if remote else "?"


def is_relayed(conn: Any) -> bool:
    """Whether a (muxed or swarm) connection runs through a relay (`/p2p-circuit`)."""
    try:
        addrs = conn.get_transport_addresses() or []
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


def connection_paths(host: IHost, peer: bytes) -> list[str]:
    """`direct` or `relayed` for each open connection to `peer`."""
    conns = host.get_network().get_connections(peer_id_from_public_key(peer))
    return ["relayed" if is_relayed(c) else "direct" for c in conns]


def listen_multiaddr(host: str, port: int) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(f"/ip4/{host}/tcp/{port}")


def transport_addrs(host: IHost, announce: str) -> list[str]:
    """Listening multiaddrs without `/p2p`, their IPv4 host replaced by `announce` (the bound
    address itself unless an announce override, e.g. a NAT's public IP, says otherwise; the
    blob side channel announces the same host)."""
    out = []
    for addr in host.get_transport_addrs():
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            parts[2] = announce
        out.append("/".join(parts))
    return out


async def connect(host: IHost, peer: bytes, addrs: list[str]) -> None:
    peer_id = peer_id_from_public_key(peer)
    if host.get_network().get_connections(peer_id):
        return
    await host.connect(PeerInfo(peer_id, [multiaddr.Multiaddr(a) for a in addrs]))


async def disconnect(host: IHost, peer: bytes) -> None:
    try:
        await host.disconnect(peer_id_from_public_key(peer))
    except Exception as e:
        logger.debug("disconnect %s: %s", peer.hex()[:10], e)


async def close_all_connections(host: IHost) -> None:
    """Close every connection at once (the swarm closes them one by one), then the swarm."""
    swarm: Any = host.get_network()

    async def close(conn: Any) -> None:
        with contextlib.suppress(Exception):
            await conn.close()

    async with trio.open_nursery() as nursery:
        for conns in list(swarm.connections.values()):
            for conn in list(conns):
                nursery.start_soon(close, conn)
    await swarm.close()


async def measure_rtt(host: IHost, peer: bytes, timeout: float = 5.0) -> float:
    """One ping round trip in seconds, timed here (py-libp2p's ping rounds to whole ms)."""
    import os

    with trio.fail_after(timeout):
        stream = await host.new_stream(peer_id_from_public_key(peer), [PING_PROTOCOL_ID])
        try:
            payload = os.urandom(PING_LENGTH)
            start = trio.current_time()
            await stream.write(payload)
            echoed = await read_exactly(stream, PING_LENGTH)
            rtt = trio.current_time() - start
        finally:
            await stream.close()
    if echoed != payload:
        raise ValueError("ping payload mismatch")
    return rtt


async def read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise StreamEOF()
        buf += chunk
    return bytes(buf)


class ReadLimitExceeded(ValueError):
    pass


async def read_to_end(stream: INetStream, limit: int) -> bytes:
    """Everything until the peer half-closes; more than `limit` bytes is an error (upstream's
    `read_to_end(limit)`)."""
    buf = bytearray()
    while True:
        try:
            chunk = await stream.read(limit + 1 - len(buf))
        except StreamEOF:
            break
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ReadLimitExceeded(f"more than {limit} bytes")
    return bytes(buf)


def protocol(name: str) -> TProtocol:
    return TProtocol(name)


async def reset_quietly(stream: INetStream) -> None:
    with contextlib.suppress(Exception):
        await stream.reset()


async def request(
    host: IHost, peer: bytes, protocol_name: str, data: bytes, response_limit: int
) -> bytes:
    """One exchange on a fresh stream to `peer`: write `data`, half-close, read the answer (at
    most `response_limit` bytes) until the peer closes."""
    stream = await host.new_stream(peer_id_from_public_key(peer), [protocol(protocol_name)])
    try:
        await stream.write(data)
        await stream.close()
        return await read_to_end(stream, response_limit)
    finally:
        await reset_quietly(stream)


async def stream_peer(stream: INetStream, allowed: AllowFn) -> bytes | None:
    """The remote key of an inbound stream if it may talk to us; otherwise the stream is reset
    and None returned (the protocol handlers' re-check of the allowlist)."""
    peer = peer_key(stream.muxed_conn.peer_id)
    if peer is None or not allowed(peer):
        await reset_quietly(stream)
        return None
    return peer


__all__ = [
    "ConnectionNotifee",
    "ReadLimitExceeded",
    "StreamError",
    "build_host",
    "connect",
    "connection_paths",
    "disconnect",
    "install_allowlist_gate",
    "is_relayed",
    "listen_multiaddr",
    "measure_rtt",
    "peer_key",
    "protocol",
    "read_exactly",
    "read_to_end",
    "request",
    "reset_quietly",
    "stream_peer",
    "transport_addrs",
]
